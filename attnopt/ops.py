"""Public ops: each rewrite form's kernels as functions over SDPA-layout tensors
(q [B, H, N, D], k/v [B, Hkv, N, D]).

Each is backed by a `torch.library` custom op (one node under torch.export, fake and autograd
registered) and has an explicit quadratic reference beside it for testing. The list comes from the
forms registry (`Form.public_ops`), so a new form's op appears here without editing this file.
"""

from attnopt import forms as _forms

__all__ = []
for _form in _forms.registry().values():
    for _name, _fn in _form.public_ops().items():
        globals()[_name] = _fn
        __all__.append(_name)
del _form, _name, _fn
