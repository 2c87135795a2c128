"""Pretrain the embedded shapes model (flowrl/shapes/weights) from scratch on rendered shapes, on CPU.

Stages (each with its own time budget, ``--minutes VAE TRANSFORMER``):

1. VAE: ``AutoencoderKL`` (factor 2) on freshly rendered images of random specs (every task, every
   colour–shape pair: the VAE is a pixel codec, it never sees prompts), L1 + MSE + ``kl_weight``·KL.
   Then ``shift_factor`` / ``scaling_factor`` are set to the mean and 1 / std of sampled latents,
   and the detector is run on reconstructions of the held-out eval renders (an upper bound for
   the generator).
2. Latents: ``--dataset-size`` renders of the *train* prompts (prompt_sets.prompt_sets: task-balanced, the
   held-out colour–shape pairs never appear) are encoded once; the posterior mean and std are kept,
   so each step draws a fresh posterior sample without running the encoder.
3. Transformer + both CLIP text encoders, jointly: rectified flow (x_t = (1 - t)·x0 + t·ε, target
   v = ε - x0, t logit-normal), ``--cond-dropout`` of prompts replaced by "" (for guidance), AdamW
   with warm-up and a linear decay over the last ``--decay-frac`` of the budget, EMA of the weights.
   The EMA pipeline is saved every ``--save-every`` minutes (atomically: a temporary folder renamed
   over ``--out``), so an interrupted run keeps its last good pipeline.
4. Final evaluation of the EMA pipeline on the held-out eval prompts through the plain diffusers
   call (ODE / Euler): strict accuracy overall and per task and colours-found rate at guidance 1 and
   3 with 20 steps, and at guidance 1 with 10 steps. Written to
   ``--out/pretrain_report.json`` with the loss curves (``loss_curves.json`` / ``.png``) and a
   sample grid (``samples.png``).

Example (the shipped weights)::

    python scripts/pretrain_shapes.py --minutes 15 100 --max-steps 7000 --out flowrl/shapes/weights   # ≈ 76 min

Smoke test::

    python scripts/pretrain_shapes.py --minutes 0.3 --dataset-size 512 --eval-size 20 --out runs/smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

# On a shared CPU, OpenMP threads that spin at barriers while another process holds a core make a
# 2-thread step ~6x slower than 1 thread (measured: 12 s vs 1.9 s); passive waiting avoids that.
if "OMP_WAIT_POLICY" not in os.environ:  # short spin, then sleep (flowrl/commands/main.py)
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.shapes import prompt_sets, world  # noqa: E402
from flowrl.shapes.caption_noise import KINDS, CaptionNoise  # noqa: E402
from flowrl.shapes.pipeline import (  # noqa: E402
    CLIP_MAX_LENGTH,
    MAX_SEQUENCE_LENGTH,
    build_shapes_pipeline,
    write_generation_defaults,
)
from flowrl_rewards.compositional.shapes import ShapesReward  # noqa: E402

# ----------------------------------------------------------------------------------------- helpers


def render_batch(specs: list[world.Spec], rng: np.random.Generator) -> torch.Tensor:
    """Render specs → float images [B, 3, 32, 32] in [-1, 1] (the VAE's input range)."""
    arr = np.stack([world.render(s, rng) for s in specs])  # uint8 [B, 32, 32, 3]
    x = torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return x.contiguous()


def to_unit(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] → [0, 1], clamped."""
    return ((x + 1) / 2).clamp(0, 1)


def atomic_save(pipe, out: Path, extra_json: dict[str, object], extra_files: dict[str, Path]) -> None:
    """Save ``pipe`` + generation defaults + extra JSON/files into a temporary sibling folder, then
    rename it over ``out`` (the previous content survives any interruption before the rename)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp"
    old = out.parent / f".{out.name}.old"
    for d in (tmp, old):
        if d.exists():
            shutil.rmtree(d)
    pipe.save_pretrained(tmp, safe_serialization=True)
    write_generation_defaults(tmp)
    for name, obj in extra_json.items():
        (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
    for name, src in extra_files.items():
        if Path(src).is_file():
            shutil.copyfile(src, tmp / name)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)


def smooth(values: list[float], window: int) -> list[float]:
    """Means over consecutive windows of ``window`` values."""
    return [float(np.mean(values[i : i + window])) for i in range(0, len(values), window)]


def save_curves(
    path_png: Path, path_json: Path, vae_losses: list[float], tr_losses: list[float], quick_evals: list[dict]
) -> None:
    """Loss curves (per step, also smoothed) as JSON and a PNG with up to three panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path_json.write_text(
        json.dumps({"vae_loss": vae_losses, "transformer_loss": tr_losses, "quick_evals": quick_evals}) + "\n"
    )
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, losses, title in (
        (axes[0], vae_losses, "VAE loss (L1 + MSE + KL)"),
        (axes[1], tr_losses, "flow-matching loss"),
    ):
        if losses:
            w = max(1, len(losses) // 200)
            ax.plot(np.arange(len(losses)), losses, alpha=0.25, lw=0.5)
            ax.plot(np.arange(0, len(losses), w) + w / 2, smooth(losses, w), lw=1.5)
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
    if quick_evals:
        steps = [q["step"] for q in quick_evals]
        axes[2].plot(steps, [q["accuracy"] for q in quick_evals], "o-", label="strict accuracy")
        axes[2].plot(steps, [q["colors_found"] for q in quick_evals], "s-", label="colours found")
        axes[2].set_ylim(0, 1)
        axes[2].legend()
    axes[2].set_title("held-out quick eval (guidance 1, 10 steps)")
    axes[2].set_xlabel("transformer step")
    fig.tight_layout()
    fig.savefig(path_png, dpi=90)
    plt.close(fig)


def save_run_curves(work: Path, history: dict, tr_losses: list[float], quick: list[dict]) -> dict[str, Path]:
    """Write this run's curves, continuing ``history`` (earlier runs, ``--init-from``), into ``work``;
    returns {file name: path} of the written files for :func:`atomic_save`."""
    files = {"loss_curves.png": work / "loss_curves.png", "loss_curves.json": work / "loss_curves.json"}
    save_curves(
        files["loss_curves.png"],
        files["loss_curves.json"],
        history["vae_loss"],
        history["transformer_loss"] + tr_losses,
        history["quick_evals"] + quick,
    )
    return files


def save_grid(path: Path, images: torch.Tensor, ncol: int = 16) -> None:
    """Save images [N, 3, H, W] in [0, 1] as one PNG grid (1 px grey separators)."""
    from PIL import Image

    n, _, h, w = images.shape
    nrow = math.ceil(n / ncol)
    grid = torch.full((3, nrow * (h + 1) + 1, ncol * (w + 1) + 1), 0.3)
    for i in range(n):
        r, c = divmod(i, ncol)
        grid[:, 1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + c * (w + 1) : 1 + c * (w + 1) + w] = images[i]
    arr = (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    Image.fromarray(arr).save(path)


# --------------------------------------------------------------------------------------- text path


def tokenize(pipe, prompts: list[str]) -> torch.Tensor:
    """Token ids [B, CLIP_MAX_LENGTH] exactly as the SD3 pipeline makes them (pad to max length)."""
    return pipe.tokenizer(
        prompts, padding="max_length", max_length=pipe.tokenizer_max_length, truncation=True, return_tensors="pt"
    ).input_ids


def encode_ids(text_encoders, ids: torch.Tensor, max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable SD3 text conditioning without T5, identical to ``pipe.encode_prompt``.

    ids [B, L] → prompt_embeds [B, L + max_sequence_length, 128] (penultimate hidden states of both
    CLIP encoders concatenated, then ``max_sequence_length`` zero tokens), pooled [B, 64].
    """
    hidden, pooled = [], []
    for enc in text_encoders:
        out = enc(ids, output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled.append(out.text_embeds)
    clip = torch.cat(hidden, dim=-1)
    zeros = clip.new_zeros(clip.shape[0], max_sequence_length, clip.shape[-1])
    return torch.cat([clip, zeros], dim=1), torch.cat(pooled, dim=-1)


def make_pipe(template, transformer, text_encoder, text_encoder_2):
    """A StableDiffusion3Pipeline sharing VAE, tokenizers and scheduler of ``template``."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=copy.deepcopy(template.scheduler),
        vae=template.vae,
        text_encoder=text_encoder,
        tokenizer=template.tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=template.tokenizer_2,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def generate(pipe, prompts: list[str], guidance: float, steps: int, seed: int, batch: int = 120) -> torch.Tensor:
    """Images [N, 3, 32, 32] in [0, 1] from the plain pipeline call (Euler ODE); image i uses the
    generator seeded ``seed + i``, so results do not depend on ``batch``."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        gens = [torch.Generator().manual_seed(seed + i + j) for j in range(len(chunk))]
        res = pipe(
            chunk,
            num_inference_steps=steps,
            guidance_scale=guidance,
            height=world.CANVAS,
            width=world.CANVAS,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            generator=gens,
            output_type="pt",
        )
        out.append(res.images.float().clamp(0, 1))
    return torch.cat(out)


# --------------------------------------------------------------------------------------- VAE stage


def train_vae(vae, args, log: dict) -> list[float]:
    """Train ``vae`` in place on fresh renders; returns per-step losses.

    Runs until ``--vae-max-steps`` or the VAE time budget. Every ``--vae-check-every`` steps the
    reconstruction MSE and the detector's strict accuracy on reconstructions of 256 fixed renders
    are logged; once both reach ``--vae-target-mse`` / ``--vae-target-acc`` the run ends after a
    short tail (``--vae-tail`` steps) of decaying learning rate. The lr warms up over 50 steps and
    decays linearly to 0.1× over the last 30% of the remaining steps or time.
    """
    rng = np.random.default_rng([args.seed, 10])
    gen = torch.Generator().manual_seed(args.seed * 1000 + 11)
    check_rng = np.random.default_rng([args.seed, 12])
    check_specs = [world.sample_spec(check_rng) for _ in range(256)]
    check_x = render_batch(check_specs, check_rng)  # [256, 3, 32, 32] fixed set
    check_prompts = [world.to_prompt(s) for s in check_specs]
    reward = ShapesReward()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    budget = args.vae_minutes * 60
    end_step = args.vae_max_steps
    losses: list[float] = []
    checks: list[dict] = []
    vae.train()
    start = time.time()
    bar = tqdm(total=end_step, unit="step", desc="VAE", mininterval=5, dynamic_ncols=True)
    step = 0
    while step < end_step and time.time() - start < budget:
        remaining = min(1 - step / end_step, 1 - (time.time() - start) / budget)
        lr_scale = min(1.0, (step + 1) / 50) * (0.1 + 0.9 * min(1.0, remaining / 0.3))
        for g in opt.param_groups:
            g["lr"] = args.vae_lr * lr_scale
        x = render_batch([world.sample_spec(rng) for _ in range(args.vae_batch)], rng)  # [B, 3, 32, 32]
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        recon = vae.decode(z).sample
        kl = post.kl().mean() / z[0].numel()  # per latent element
        loss = F.l1_loss(recon, x) + F.mse_loss(recon, x) + args.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
        if step % args.vae_check_every == 0:
            vae.eval()
            with torch.no_grad():
                rec = vae.decode(vae.encode(check_x).latent_dist.mean).sample
            vae.train()
            mse = float(F.mse_loss(to_unit(rec), to_unit(check_x)))
            acc = reward.evaluate(to_unit(rec), check_prompts)["accuracy"]
            checks.append({"step": step, "seconds": round(time.time() - start, 1), "mse": mse, "detector": acc})
            tqdm.write(f"VAE step {step}: recon MSE {mse:.5f}, detector on reconstructions {acc:.3f}")
            if acc >= args.vae_target_acc and mse <= args.vae_target_mse and end_step > step + args.vae_tail:
                end_step = step + args.vae_tail
                bar.total = end_step
                tqdm.write(f"VAE targets reached: finishing with {args.vae_tail} decaying-lr steps")
    bar.close()
    vae.eval()
    log["vae_steps"] = step
    log["vae_seconds"] = round(time.time() - start, 1)
    log["vae_checks"] = checks
    return losses


@torch.no_grad()
def calibrate_and_check_vae(vae, eval_prompts: list[str], args, log: dict) -> None:
    """Set shift/scaling factors from sampled latents of fresh renders; detector on reconstructions."""
    rng = np.random.default_rng([args.seed, 20])
    gen = torch.Generator().manual_seed(args.seed * 1000 + 21)
    zs = []
    for _ in range(args.calib_size // 256):
        x = render_batch([world.sample_spec(rng) for _ in range(256)], rng)
        post = vae.encode(x).latent_dist
        zs.append(post.mean + post.std * torch.randn(post.mean.shape, generator=gen))
    z = torch.cat(zs)
    mean, std = float(z.mean()), float(z.std())
    vae.register_to_config(shift_factor=mean, scaling_factor=1.0 / std)
    log["vae_latent_mean"], log["vae_latent_std"] = mean, std
    log["vae_shift_factor"], log["vae_scaling_factor"] = mean, 1.0 / std
    log["vae_posterior_std_mean"] = float(vae.encode(x).latent_dist.std.mean())

    # Reconstructions of the held-out eval renders (decoded from the posterior mean).
    x = render_batch([world.parse(p) for p in eval_prompts], rng)
    recon = torch.cat([vae.decode(vae.encode(x[i : i + 256]).latent_dist.mean).sample for i in range(0, len(x), 256)])
    reward = ShapesReward()
    log["vae_recon_mse"] = float(F.mse_loss(to_unit(recon), to_unit(x)))
    log["detector_on_renders"] = reward.evaluate(to_unit(x), eval_prompts)
    log["detector_on_vae_reconstructions"] = reward.evaluate(to_unit(recon), eval_prompts)
    tqdm.write(
        f"VAE: latent mean {mean:.3f} std {std:.3f}; recon MSE {log['vae_recon_mse']:.5f}; detector on "
        f"reconstructions {log['detector_on_vae_reconstructions']['accuracy']:.3f}"
    )


# ---------------------------------------------------------------------------------------- latents


@torch.no_grad()
def encode_dataset(vae, train_prompts: list[str], args, log: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Render ``args.dataset_size`` images of train prompts and encode them.

    Returns posterior mean and std [N, 4, 16, 16] (unscaled) and prompt indices [N] into
    ``train_prompts`` (uniform over the task-balanced train list). With ``--caption-noise`` the image of
    a caption is drawn from a one-fact-wrong spec with the probability of its kind
    (:mod:`flowrl.shapes.caption_noise`); the setting and the counts flipped go into ``log``.
    """
    rng = np.random.default_rng([args.seed, 30])
    idx = rng.integers(len(train_prompts), size=args.dataset_size)
    specs = [world.parse(p) for p in train_prompts]
    noise = CaptionNoise.parse(args.caption_noise)
    if noise.any():  # draw each image from its caption's spec or a one-fact-wrong version of it
        noise_rng = np.random.default_rng([args.seed, 31])
        held = prompt_sets.held_out_pairs(args.seed)
        drawn = [noise.apply(specs[k], noise_rng, held) for k in idx]
        kinds = [kind for _, kind in drawn]
        log["caption_noise"] = {
            "setting": asdict(noise),
            "images": len(drawn),
            "flipped": {k: kinds.count(k) for k in KINDS},
        }
        drawn_specs = [spec for spec, _ in drawn]
    else:
        drawn_specs = [specs[k] for k in idx]
    means, stds = [], []
    bs = 256
    for i in tqdm(range(0, args.dataset_size, bs), desc="encode latents", mininterval=5, dynamic_ncols=True):
        x = render_batch(drawn_specs[i : i + bs], rng)
        post = vae.encode(x).latent_dist
        means.append(post.mean)
        stds.append(post.std)
    return torch.cat(means), torch.cat(stds), torch.from_numpy(idx).long()


# -------------------------------------------------------------------------------- transformer stage


def lr_factor(step: int, progress: float, warmup: int, decay_frac: float) -> float:
    """Linear warm-up over ``warmup`` steps; constant; linear decay to 0.1 over the last
    ``decay_frac`` of progress (progress in [0, 1] = max of step and time fractions)."""
    warm = min(1.0, (step + 1) / warmup)
    if progress < 1 - decay_frac:
        return warm
    return warm * (0.1 + 0.9 * max(0.0, 1 - progress) / decay_frac)


def train_transformer(
    pipe, data, train_prompts: list[str], eval_prompts: list[str], args, log: dict, history: dict, work: Path
) -> tuple[object, list[float], list[dict]]:
    """Jointly train transformer + both text encoders; returns (EMA pipeline, losses, quick evals).

    ``history``: curves of earlier runs (``vae_loss``, ``transformer_loss``, ``quick_evals``) that the
    saved loss curves start with (``--init-from``); quick-eval steps here count on from them.
    """
    step_offset = len(history["transformer_loss"])
    means, stds, prompt_idx = data
    shift, scale = pipe.vae.config.shift_factor, pipe.vae.config.scaling_factor
    ids_all = tokenize(pipe, train_prompts)  # [P, L]
    ids_empty = tokenize(pipe, [""])  # [1, L]

    modules = torch.nn.ModuleDict(
        {"transformer": pipe.transformer, "te1": pipe.text_encoder, "te2": pipe.text_encoder_2}
    )
    ema = copy.deepcopy(modules).eval().requires_grad_(False)
    ema_pipe = make_pipe(pipe, ema["transformer"], ema["te1"], ema["te2"])
    params = [p for p in modules.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    log["transformer_params"] = sum(p.numel() for p in pipe.transformer.parameters())
    log["text_encoder_params"] = sum(p.numel() for p in pipe.text_encoder.parameters())

    # The differentiable text path must equal what the pipeline feeds the transformer at sampling time.
    with torch.no_grad():
        check = ["a red circle", "two blue squares", ""]
        pe, pooled = encode_ids([pipe.text_encoder, pipe.text_encoder_2], tokenize(pipe, check), MAX_SEQUENCE_LENGTH)
        pe_ref, _, pooled_ref, _ = pipe.encode_prompt(
            check, check, None, do_classifier_free_guidance=False, max_sequence_length=MAX_SEQUENCE_LENGTH
        )
        assert pe.shape == pe_ref.shape and torch.allclose(pe, pe_ref, atol=1e-6), "text path differs from pipeline"
        assert torch.allclose(pooled, pooled_ref, atol=1e-6), "pooled text path differs from pipeline"

    gen = torch.Generator().manual_seed(args.seed * 1000 + 41)
    n_data = means.shape[0]
    budget = args.minutes * 60
    losses: list[float] = []
    quick: list[dict] = []
    modules.train()
    start = time.time()
    last_eval = last_save = start
    bar = tqdm(total=round(budget), unit="s", desc="transformer", mininterval=10, dynamic_ncols=True)
    step = 0
    while True:
        elapsed = time.time() - start
        progress = max(elapsed / budget, step / args.max_steps)
        if progress >= 1:
            break
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_factor(step, progress, args.warmup, args.decay_frac)

        b = torch.randint(n_data, (args.batch,), generator=gen)
        eps_post = torch.randn(means[b].shape, generator=gen)
        x0 = (means[b] + stds[b] * eps_post - shift) * scale  # [B, 4, 16, 16], ~N(0, 1)
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.sigmoid(torch.randn(args.batch, generator=gen) * args.logit_std + args.logit_mean)  # [B]
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
        drop = torch.rand(args.batch, generator=gen) < args.cond_dropout
        ids = torch.where(drop[:, None], ids_empty, ids_all[prompt_idx[b]])

        prompt_embeds, pooled = encode_ids([pipe.text_encoder, pipe.text_encoder_2], ids, MAX_SEQUENCE_LENGTH)
        v = pipe.transformer(
            hidden_states=xt,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
            timestep=t * 1000,
            return_dict=False,
        )[0]
        loss = F.mse_loss(v, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), modules.parameters()):
                p_ema.lerp_(p.detach(), 1 - decay)
        losses.append(float(loss.detach()))
        step += 1

        now = time.time()
        if step % 10 == 0:
            bar.n = min(round(now - start), bar.total)
            bar.set_postfix(step=step, loss=f"{np.mean(losses[-100:]):.4f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
        if now - last_eval >= args.eval_every * 60:
            res = ShapesReward().evaluate(
                generate(ema_pipe, eval_prompts[: args.quick_eval_size], 1.0, 10, args.seed + 10_000),
                eval_prompts[: args.quick_eval_size],
            )
            res.update(step=step_offset + step, minutes=round((now - start) / 60, 2))
            quick.append(res)
            tqdm.write(
                f"[{res['minutes']:.1f} min, step {step}] quick eval (g1, 10 steps, "
                f"{res['n']} prompts): strict {res['accuracy']:.3f}, colours {res['colors_found']:.3f}"
            )
            last_eval = time.time()
        if now - last_save >= args.save_every * 60:
            log["transformer_steps"], log["transformer_seconds"] = step, round(now - start, 1)
            log["status"] = "in progress (periodic save)"
            atomic_save(
                ema_pipe, args.out, {"pretrain_report.json": log}, save_run_curves(work, history, losses, quick)
            )
            last_save = time.time()
    bar.n = bar.total
    bar.close()
    log["transformer_steps"] = step
    log["transformer_seconds"] = round(time.time() - start, 1)
    log["transformer_steps_total"] = step_offset + step  # including earlier runs (--init-from)
    log["transformer_final_loss_last500"] = float(np.mean(losses[-500:])) if losses else None
    return ema_pipe, losses, quick


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("flowrl/shapes/weights"), help="saved pipeline folder")
    p.add_argument("--work", type=Path, default=Path("runs/pretrain_shapes"), help="scratch folder (logs, VAE stage)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--minutes", type=float, nargs="+", default=[5.0, 50.0], help="time budget: VAE TRANSFORMER (one value = both)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument(
        "--vae-from",
        type=Path,
        default=None,
        help="skip the VAE stage: take the calibrated VAE of this saved pipeline folder",
    )
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue training a saved pipeline folder (all weights; skips the VAE stage; "
        "fresh optimizer with warm-up, EMA starting from the loaded weights)",
    )
    # VAE
    p.add_argument("--vae-batch", type=int, default=32)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--vae-max-steps", type=int, default=1500)
    p.add_argument(
        "--kl-weight",
        type=float,
        default=1e-5,
        help="weight of the KL per latent element (weak: a KL summed over elements at 1e-5 collapsed 2 of the 4 "
        "channels to noise and slowed transformer training)",
    )
    p.add_argument("--vae-check-every", type=int, default=100)
    p.add_argument("--vae-target-acc", type=float, default=0.995, help="detector accuracy on reconstructions")
    p.add_argument("--vae-target-mse", type=float, default=0.002, help="reconstruction MSE (images in [0, 1])")
    p.add_argument("--vae-tail", type=int, default=150, help="decaying-lr steps after the targets are reached")
    p.add_argument("--calib-size", type=int, default=2048, help="renders used to measure latent mean/std")
    # data
    p.add_argument("--dataset-size", type=int, default=50_000, help="train renders encoded once")
    p.add_argument(
        "--caption-noise",
        default="",
        help="web-like caption noise: KIND=P,... with KIND in count, mirror, swap, "
        "drop (flowrl/shapes/caption_noise.py): that fraction of a task's images is drawn one fact wrong "
        "while the caption stays, e.g. count=0.7,mirror=0.7,swap=0.7,drop=0.5",
    )
    # transformer
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--decay-frac", type=float, default=0.2, help="final fraction of the budget with linear lr decay")
    p.add_argument("--max-steps", type=int, default=10**9)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--cond-dropout", type=float, default=0.1)
    p.add_argument("--logit-mean", type=float, default=0.0)
    p.add_argument("--logit-std", type=float, default=1.0)
    # evaluation and saving
    p.add_argument("--eval-every", type=float, default=5.0, help="minutes between quick evals")
    p.add_argument("--quick-eval-size", type=int, default=120)
    p.add_argument("--save-every", type=float, default=10.0, help="minutes between atomic saves")
    p.add_argument("--eval-size", type=int, default=None, help="held-out prompts in the final eval (all: 240)")
    args = p.parse_args(argv)
    try:
        CaptionNoise.parse(args.caption_noise)
    except ValueError as e:
        p.error(f"--caption-noise: {e}")
    if len(args.minutes) == 1:
        args.minutes = args.minutes * 2
    if len(args.minutes) != 2:
        p.error("--minutes takes one value (both stages) or two (VAE TRANSFORMER)")
    args.vae_minutes, args.minutes = args.minutes
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    train_prompts, eval_prompts = prompt_sets.prompt_sets(args.seed)
    if args.eval_size is not None:
        eval_prompts = eval_prompts[: args.eval_size]
    log: dict = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "threads": args.threads,
        "clip_max_length": CLIP_MAX_LENGTH,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "held_out_pairs": prompt_sets.held_out_pairs(args.seed),
        "n_train_prompts": len(train_prompts),
        "n_distinct_train_prompts": len(set(train_prompts)),
        "n_eval_prompts": len(eval_prompts),
    }

    if args.init_from is not None:
        from flowrl.shapes.pipeline import load_shapes_pipeline

        pipe = load_shapes_pipeline(args.init_from)
        for module in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2):
            module.requires_grad_(True)
        log["init_from"] = str(args.init_from)
        previous = Path(args.init_from) / "pretrain_report.json"
        if previous.is_file():
            log["init_from_report"] = json.loads(previous.read_text())
            # One line per earlier invocation, oldest first: where it started and how far it trained.
            log["lineage"] = log["init_from_report"].get("lineage", []) + [
                {
                    key: log["init_from_report"].get(key)
                    for key in (
                        "init_from",
                        "vae_steps",
                        "vae_seconds",
                        "transformer_steps",
                        "transformer_seconds",
                        "total_minutes",
                    )
                }
            ]
    else:
        pipe = build_shapes_pipeline(seed=args.seed)
    log["vae_params"] = sum(p.numel() for p in pipe.vae.parameters())

    # 1. VAE
    vae_losses: list[float] = []
    if args.init_from is not None:
        pass  # the loaded pipeline's VAE, already calibrated
    elif args.vae_from is not None:
        from diffusers import AutoencoderKL

        pipe.vae = AutoencoderKL.from_pretrained(args.vae_from, subfolder="vae").eval()
        log["vae_from"] = str(args.vae_from)
        pipe.register_modules(vae=pipe.vae)
    else:
        vae_losses = train_vae(pipe.vae, args, log)
        calibrate_and_check_vae(pipe.vae, eval_prompts, args, log)
        pipe.vae.requires_grad_(False)
        pipe.save_pretrained(work / "vae_stage", safe_serialization=True)  # for --vae-from
    pipe.vae.requires_grad_(False)

    history = {"vae_loss": vae_losses, "transformer_loss": [], "quick_evals": []}
    if args.init_from is not None and (Path(args.init_from) / "loss_curves.json").is_file():
        history = json.loads((Path(args.init_from) / "loss_curves.json").read_text())

    # 2. Latents of the training set
    t0 = time.time()
    # The encoded set depends on seed, size and the VAE: cache it in --work for later runs on the same VAE.
    vae_id = f"{sum(float(p.double().sum()) for p in pipe.vae.parameters()):.10e}"
    noise_tag = args.caption_noise.replace(",", "_").replace("=", "") if args.caption_noise else "clean"
    cache = work / f"latents_seed{args.seed}_n{args.dataset_size}_{noise_tag}.pt"
    saved = torch.load(cache) if cache.is_file() else None
    if saved is not None and saved["vae_id"] == vae_id:
        data = (saved["mean"], saved["std"], saved["prompt_idx"])
        log["latents_from_cache"] = str(cache)
        if "caption_noise" in saved:
            log["caption_noise"] = saved["caption_noise"]
    else:
        data = encode_dataset(pipe.vae, train_prompts, args, log)
        torch.save(
            {
                "vae_id": vae_id,
                "mean": data[0],
                "std": data[1],
                "prompt_idx": data[2],
                "caption_noise": log.get("caption_noise"),
            },
            cache,
        )
    log["encode_seconds"] = round(time.time() - t0, 1)

    # 3. Transformer + text encoders
    ema_pipe, tr_losses, quick = train_transformer(pipe, data, train_prompts, eval_prompts, args, log, history, work)

    # 4. Final held-out evaluation of the EMA pipeline through the plain diffusers call
    t0 = time.time()
    reward = ShapesReward()
    final = {}
    grids = []
    for guidance, steps in ((1.0, 20), (3.0, 20), (1.0, 10)):
        images = generate(ema_pipe, eval_prompts, guidance, steps, seed=args.seed + 20_000)
        res = reward.evaluate(images, eval_prompts)
        final[f"guidance{guidance:g}_steps{steps}"] = res
        grids.append(images[:64])
        tqdm.write(
            f"final eval guidance {guidance:g}, {steps} steps: strict {res['accuracy']:.3f}, colours found "
            f"{res['colors_found']:.3f}, "
            + ", ".join(f"{t} {res.get('accuracy/' + t, float('nan')):.2f}" for t in world.TASKS)
        )
    log["final_eval"] = final
    log["final_eval_seconds"] = round(time.time() - t0, 1)
    log["total_minutes"] = round((time.time() - t_start) / 60, 2)
    log["status"] = "done"
    log["samples_png"] = "first 64 eval prompts; rows of 16: guidance 1 / 20 steps (rows 1-4), guidance 3 (5-8)"
    save_grid(work / "samples.png", torch.cat(grids[:2]), ncol=16)
    curves = save_run_curves(work, history, tr_losses, quick)
    (work / "pretrain_report.json").write_text(json.dumps(log, indent=2) + "\n")
    atomic_save(ema_pipe, args.out, {"pretrain_report.json": log}, {**curves, "samples.png": work / "samples.png"})
    size_mb = sum(f.stat().st_size for f in Path(args.out).rglob("*") if f.is_file()) / 2**20
    tqdm.write(f"saved {args.out} ({size_mb:.1f} MB) in {log['total_minutes']:.1f} min total")


if __name__ == "__main__":
    main()
