"""The ``diffusion`` study (``hardeq reproduce diffusion``): brightness-constrained images from one DDPM U-Net."""
