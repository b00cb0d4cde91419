"""``python -m scripts.bench``: the GPU benchmarks (see ``scripts/bench/run.py``)."""

from scripts.bench.run import main

main()
