"""The pipeline's stages, one module each (python -m stages.<name>); importing the package pins the CPU numerics."""
from lora_pipeline.cpu_numerics import pin

pin()  # before any stage imports torch: python -m stages.<name> runs this first
