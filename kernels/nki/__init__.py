"""NKI kernels for AWS Trainium: `ms_deform_attn.py` (forward and backward, the Neuron kernel
library's signature) and `torch_op.py` (the authors' `MSDeformAttnFunction` on them).

Neither is imported by `kernels`: both need the `nki` package from the Neuron repository
(pip.repos.neuron.amazonaws.com; the `nki` on PyPI is a placeholder that refuses to import)."""
