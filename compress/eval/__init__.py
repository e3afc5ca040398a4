"""Quality and latency evaluation of models and compressed variants (installed as compress.eval)."""
