"""What every form's Triton kernels share: the runtime (launch paths, block sizes, the fused feature
maps), the chunk scan of linear states, band visibility and the one-token state step.

The kernels themselves live with their form (`attnopt/forms/<form>/triton.py`), each with the keyword
signature of its reference op and an `unsupported(q, **kwargs)` check; ask a form
`forms.get(name).triton_supported(q, ...)`. Layout is SDPA's: q [B, H, Nq, D], k [B, Hkv, Nk, D],
v [B, Hkv, Nk, Dv] -> [B, H, Nq, Dv] in q's dtype (fp32, bf16, fp16; fp32 accumulation). On CUDA each
op is a `torch.library.triton_op` (namespace `attnopt_triton`); with TRITON_INTERPRET=1 the same
kernels run on CPU tensors in Triton's interpreter (tests).
"""
