"""Code the tests and the benchmarks share; not part of the installed package.

- ``testkit.notebook_models``: the notebooks' plain-PyTorch models, the
  oracle of the compat and patch tests and the eager baselines of the benchmarks.
- ``testkit.memory``: ``peak_memory_bytes``, the peak memory torch
  allocates during a call, on a CPU or a GPU.
- ``testkit.hf``: ``cache_keyword``, the name transformers' models give the
  KV cache argument in the installed release.
- ``testkit.gloo``: ``spawn``, a function run on several CPU processes joined
  by gloo (the distributed-training tests).
- ``testkit.env``: ``env_var``, an environment variable set inside a block
  (the kernel requests of fusedllm's CUDA dispatch).

Importable from the repository root: pytest puts the root on ``sys.path``
(``pythonpath`` in pyproject.toml), ``python -m benchmarks.<script>`` runs from
it, and the benchmark scripts run as files put it there themselves.
"""
