"""jaxspec: lossless speculative decoding (DFlash drafter + DDTree verification) in JAX."""
from jaxspec.api import GenerationResult, generate
from jaxspec.drafter import Drafter, init_drafter, load_drafter
from jaxspec.model import Model, load, quantize_model, random_model
from jaxspec.sharding import make_mesh

__all__ = ["load", "load_drafter", "init_drafter", "generate", "GenerationResult", "Model", "Drafter", "random_model",
           "quantize_model", "make_mesh"]
__version__ = "0.1.0"
