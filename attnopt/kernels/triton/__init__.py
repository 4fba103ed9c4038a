"""What every form's Triton kernels share, so that a form's `triton.py` holds only its own kernels:

* `tiles`: `@triton.jit` tile arithmetic (program ids, index spans, masked tile loads and stores,
  the key mask, the fused feature maps, the dot precision rule);
* `chunk_scan`: the chunked linear-state scans and their chunk-step helpers (linear, ssm, gla, delta,
  linear+window);
* `band` and `softmax`: band + sink visibility and its key walk, the online softmax (window,
  linear+window, reuse);
* `runtime`: launch paths, the entry-point checks, host launch arguments; `differentiable`: the
  triton_op / interpreter autograd of the differentiable ops; `state_step`: the one-token state step.

The kernels themselves live with their form (`attnopt/forms/<form>/triton.py`), each with the keyword
signature of its reference op and an `unsupported(q, **kwargs)` check; ask a form
`forms.get(name).triton_supported(q, ...)`. Layout is SDPA's: q [B, H, Nq, D], k [B, Hkv, Nk, D],
v [B, Hkv, Nk, Dv] -> [B, H, Nq, Dv] in q's dtype (fp32, bf16, fp16; fp32 accumulation). On CUDA each
op is a `torch.library.triton_op` (namespace `attnopt_triton`); with TRITON_INTERPRET=1 the same
kernels run on CPU tensors in Triton's interpreter (tests).
"""
