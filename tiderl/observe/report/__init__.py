"""`tiderl report RUN_DIR [--out DIR]`: PNG figures and one Markdown summary of a run, from its store.

`data.py` reads the store into plain series, `figures.py` draws them (matplotlib,
no pyplot state), `summary.py` writes the Markdown page; the command is
`tiderl.observe_cli.report`.
"""
