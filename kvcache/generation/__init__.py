"""Running a model over a cache: batched generation over ragged prompts and the one decode loop
(generate.py), prefill on a grid of positions (prefill.py), the captured decode step
(compiled.py), and KVzip's reconstruction pass (reconstruction.py)."""
