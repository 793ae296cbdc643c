"""PyTorch front end of xkern: autograd-aware ops registered with torch.library."""

from torch_api.rms_norm import RMSNorm, rms_norm

__all__ = ["RMSNorm", "rms_norm"]
