"""The pipeline on top of the passes: ``job`` runs one recipe (passes, evaluation, export, resume,
the memory preflight) and is the one orchestration the others call; ``sweep`` runs several
recipes as jobs against one shared baseline and writes the comparison tables; ``tune`` writes a
mixed-precision recipe from a budget and runs it as a job. Only the CLI imports it.
"""
