"""The factor-2 ``AutoencoderKL`` of the tiny SD3, FLUX.1 (and Kontext) and Z-Image pipelines."""

from __future__ import annotations


def kl_vae(latent_channels: int, *, quant_convs: bool, scaling_factor: float, shift_factor: float):
    """Factor-2 ``AutoencoderKL`` (two blocks), channels (8, 8), no mid-block attention, 16 px samples; in eval mode.
    ``quant_convs``: with the (post-)quant convolutions (SD3's; FLUX.1's and Z-Image's have none). Set
    ``shift_factor`` (SD3's pipeline needs one)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=16,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        mid_block_add_attention=False,
        use_quant_conv=quant_convs,
        use_post_quant_conv=quant_convs,
    ).eval()
