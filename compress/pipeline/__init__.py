"""The pipeline on top of the passes: ``job`` runs one recipe (passes, evaluation, export, resume)
and ``sweep`` runs several recipes against one shared baseline and writes the comparison tables.
Only the CLI imports it.
"""
