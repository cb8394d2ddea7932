"""The pipeline's stages, one module each (python -m stages.<name>); importing the package pins the CPU numerics."""
from lora_pipeline.config.cpu_numerics import pin
from lora_pipeline.config.quiet import quiet

pin()  # before any stage imports torch: python -m stages.<name> runs this first
quiet()  # library notices that ask nothing of the user
