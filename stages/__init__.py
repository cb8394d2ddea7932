"""The pipeline's stages, one module each (python -m stages.<name>); importing the package pins the CPU numerics."""
import atexit
import gc

from lora_pipeline.config.cpu_numerics import pin
from lora_pipeline.config.quiet import quiet

pin()  # before any stage imports torch: python -m stages.<name> runs this first
quiet()  # library notices that ask nothing of the user
# At exit, what is still alive is left to the OS instead of a last garbage collection over every object that torch,
# transformers and peft created on import, which takes seconds. Files are closed by then; the output streams are
# flushed at exit all the same.
atexit.register(gc.freeze)
