"""GPU benchmarks of blaze on one H200: SystemOne latency, generate tokens/s, blaze edit and blaze canary.

Run from the repository root: ``python -m scripts.bench --out DIR --sections env,systemone,generate``
(``--help`` lists the sections and options). One module per section (``env``, ``systemone``,
``generate``, ``edit``, ``canary``); ``common`` holds the run's state, options and timing helpers,
``results`` the typed results object, ``models`` the model loaders, ``run`` the entry point.
BENCHMARKS.md records the runs and their figures.
"""
