"""One-off measurements behind a decision, kept so that they can be run again (``python -m
benchmarks.experiments.<name>``, GPU only). What each showed, with its rows in ``benchmarks/results/``:

* :mod:`~benchmarks.experiments.attention_layout`: SDPA's output takes the memory layout of q, so norms that gave
  Gemma 3's transposed q and k back contiguous made the view before ``o_proj`` copy, an extra activation per layer;
  the norms now return their input's layout (``h200-attention-layout.json``).
* :mod:`~benchmarks.experiments.e2e_causal_sdpa`: with no causal mask built under ``torch.compile``, compiled
  liger_lab keeps its memory lead over compiled Hugging Face but not a speed lead
  (``h200-e2e-compile-causal-sdpa.json``).
* :mod:`~benchmarks.experiments.e2e_chunk_budget`: Qwen3's extra peak was the fused loss's chunk of logits on top of
  every activation; smaller chunks brought it to Liger-Kernel's without a measurable cost in speed, hence
  ``chunk_tokens_in_model`` (``h200-e2e-chunk-budget.json``).
"""
