"""What the kernels accept, in a module without jax, so the config can check a model against it
before any kernel is imported (the kernels are a lower layer than the config: it reads this, never
the other way round)."""

FLASH_HEAD_DIMS = (64, 128)  # the head dims the flash kernels tile (flash.py, flash_hopper.py)
