"""The figures of README, docs/ and the configs' docstrings, rendered from docs/results/.

    make docs                                  # python -m docs.render.render_docs
    python -m docs.render.render_docs --check  # exit 1 if a region or a shown record is stale

render_docs.py     the regions, their rendering and the making of records (`--record`)
doc_views.py       the views (@view): each reads its records and turns them into Markdown
record_sources.py  each record file's producer; shown records not of its RECORD_VERSION

Run from the repository root: it is no part of the installed package, and it imports
the package only for what the views compute (a sweep's rows, a config's steps).
"""
