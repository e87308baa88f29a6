"""What several test modules share (fixtures stay in ``tests/conftest.py``):

- ``paths``: the repository, ``tests/datasets`` (a few rows of every prompt dataset) and
  ``tests/fixtures`` (published draft configs, recorded server replies).
- ``tiny``: the tiny random Llama target and DFlash draft, the scripted draft
  (``ScriptedBackend``), HF greedy references.
- ``static``: the static (CUDA-graph) path on a tiny pair: greedy parity, draft logits twice.
- ``stats``: the total-variation distance and one torch thread for a block.
- ``cli``: the CLI in a subprocess and its one-line ``error:``/``hint:`` checks.
- ``bench``: a scripted fake pipeline for the benchmark harness.
- ``kernels``: Triton's CPU interpreter in a subprocess, compiling for sm_90 without a GPU.
- ``target_families``, ``mlx_models``: tiny random targets per family (transformers, mlx-lm);
  ``static_families``: those targets on the static path, scripted-rollback row checks.
- ``dflash2``: a random DFlash2 draft for a tiny target.
- ``serve_scripted``, ``openai_replay``: a scripted pipeline for ``dflash serve``; a loopback
  server replaying recorded OpenAI-compatible responses.
"""
