"""Higher-order Linear Attention operators (arXiv 2510.27258): reference, scan, chunk and
Triton forms. Layout `[B, T, H, D]`; every op returns `(output, final_state)`."""

from mixers.hla.ahla2 import ahla2, ahla2_step
from mixers.hla.hla2 import hla2, hla2_step
from mixers.hla.hla3 import hla3, hla3_step

__all__ = ["hla2", "hla2_step", "ahla2", "ahla2_step", "hla3", "hla3_step"]
