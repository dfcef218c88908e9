"""The benchmark protocol's scripts, each runnable from a clone's root as ``python -m benchmarks.<name>``.

* :mod:`benchmarks.run`: every op, every implementation, the ceilings, a norm sweep (the README's op table);
* :mod:`benchmarks.sweep_shapes`, :mod:`benchmarks.sweep_tiles`, :mod:`benchmarks.sweep_chunks`: liger_lab's default
  call over a ladder of shapes, the kernels' launch settings, a fused loss's chunk sizes;
* :mod:`benchmarks.moe_experts`, :mod:`benchmarks.rl_head`, :mod:`benchmarks.dist`, :mod:`benchmarks.profile_e2e`:
  an MoE experts block, the RL head and GRPO against their peers, FSDP2 on several GPUs, a training step's kernel
  time by kind;
* :mod:`benchmarks.host_time`: the host time of liger_lab's eager calls (CPU, every kernel launch skipped);
* :mod:`benchmarks.import_results`: appends a run's result file to the results store
  (:mod:`liger_lab.workbook.results`), which the chapters read;
* :mod:`benchmarks.readme_table`: regenerates the README's and the notes' tables from that store;
* :mod:`benchmarks.experiments`: one-off measurements behind a decision, kept to be re-run.

End-to-end training per mode and preset is the CLI's (``liger-lab bench e2e``), and so is the kernel-by-kernel time
of an op (``liger-lab bench kernels``). Tests import these modules as ``benchmarks.<name>``: pytest puts the clone's
root on ``sys.path`` (``pythonpath`` in pyproject.toml's ``[tool.pytest.ini_options]``), and ``python -m`` run from
the root does the same.
"""
