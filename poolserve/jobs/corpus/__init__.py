"""`poolserve embed`: a corpus (JSONL, CSV or Parquet) embedded into Parquet, resumable.

`command` parses the flags and runs the job; `files` knows the input file (format, fingerprint,
row count); `reader` streams its rows in bounded, checked batches;
`run` keeps the engine saturated and hands whole parts to `state`, which keeps the manifest, the
numbered parts, resume and the final merge; `progress` draws the bar and the summary line.
"""
