"""Explorer benchmark on the shipped shapes model (Sol-RL, docs/explore.md): throughput and rank fidelity.

For every explorer backend this machine can run (flowrl/rollout/precision.py) and the full-precision model:
images/s of the ODE (latents only, no decode) at the preview step count and at the full step count,
and how well the explorer's preview ranks the seeds the way full precision does. The reference is the
full-precision model (the model's dtype, fp32 here) at the full step count; for each backend the
same prompts × seeds are previewed at ``--preview-steps`` and scored with each of ``--rewards``
(``shapes:MODE`` for the shapes reward in a mode, or any registered reward name), and compared per
prompt group: Spearman ρ and Kendall τ-b (mean over the prompts where neither side is constant), the
top-half hit rate (fraction of the preview's top half that is in the reference's top half) and the
same at the full step count (quantization alone).

    OMP_NUM_THREADS=1 python scripts/bench_explore.py [--prompts 8] [--seeds 8] [--preview-steps 6]
        [--steps 10] [--backends same,int8,bf16,fp16] [--rewards shapes:precise,brightness] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def timed_ode(
    model, prompts: list[str], seeds: list[int], steps: int, max_batch: int, repeats: int
) -> tuple[torch.Tensor, float]:
    """Clean latents of an ODE with ``steps`` steps and the fastest of ``repeats`` timings (seconds),
    after a warm-up call (the machine is shared: the minimum is the least disturbed run)."""
    from flowrl.rollout.sampling import ode_sample

    ode_sample(model, prompts[:2], seeds[:2], 1, max_batch=max_batch, decode=False)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x0 = ode_sample(model, prompts, seeds, steps, max_batch=max_batch, decode=False)
        best = min(best, time.perf_counter() - t0)
    return x0, best


@torch.no_grad()
def velocity_error(model, explorer_model, prompts: list[str], seeds: list[int]) -> float:
    """Relative L2 error ‖v_explorer − v‖ / ‖v‖ at σ = 0.7 on these prompts and seeds (the model's CFG)."""
    x = model.noise(seeds)
    cond = model.encode(prompts)
    sigma = torch.full((len(seeds),), 0.7)
    v = model.velocity(x, sigma, cond)
    return float((explorer_model.velocity(x, sigma, cond) - v).norm() / v.norm())


def fidelity(scores: torch.Tensor, reference: torch.Tensor, groups: int) -> dict[str, float]:
    """Mean over prompt groups of Spearman ρ, Kendall τ-b and the top-half hit rate of ``scores`` [G·S]
    against ``reference`` [G·S] (groups with a constant side are left out of ρ and τ)."""
    from flowrl.rollout.explore import _nanmean, kendall, spearman

    rho, tau, hits = [], [], []
    for a, b in zip(scores.view(groups, -1), reference.view(groups, -1)):
        rho.append(spearman(a, b))
        tau.append(kendall(a, b))
        half = a.numel() // 2
        top_a = set(torch.argsort(a, descending=True, stable=True)[:half].tolist())
        top_b = set(torch.argsort(b, descending=True, stable=True)[:half].tolist())
        hits.append(len(top_a & top_b) / half)
    return {
        "spearman": _nanmean(rho),
        "kendall": _nanmean(tau),
        "top_half_hit": _nanmean(hits),
        "groups_with_rank": float(sum(r == r for r in rho)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts (spread over the eval file)")
    parser.add_argument("--seeds", type=int, default=8, help="seeds per prompt (the pool of one group)")
    parser.add_argument("--preview-steps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="full step count (the regeneration's)")
    parser.add_argument("--backends", default=None, help="comma-separated; default: every backend this machine runs")
    parser.add_argument(
        "--rewards",
        default="shapes:precise,brightness",
        help="comma-separated: shapes:MODE or a registered reward name",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (the fastest counts)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from flowrl import load_shapes_model
    from flowrl.core.seeding import derive_seed
    from flowrl.paths import CONFIG_DIR
    from flowrl.prompts.source import read_prompts
    from flowrl.rollout.decoding import decode
    from flowrl.rollout.explorer import make_explorer
    from flowrl.rollout.precision import available_backends
    from flowrl_rewards import build_reward

    model = load_shapes_model()
    eval_prompts = read_prompts(str(CONFIG_DIR / "shapes" / "prompts" / "eval.txt"))
    step = max(1, len(eval_prompts) // args.prompts)
    chosen = eval_prompts[::step][: args.prompts]
    prompts = [p for p in chosen for _ in range(args.seeds)]
    seeds = [derive_seed("bench_explore", g, n) for g in range(len(chosen)) for n in range(args.seeds)]
    rewards = {}
    for spec in args.rewards.split(","):
        name, _, mode = spec.partition(":")
        rewards[spec] = build_reward(name, mode=mode) if mode else build_reward(name)

    def score(x0: torch.Tensor) -> dict[str, torch.Tensor]:
        images = decode(model, x0, args.max_batch)
        return {spec: reward(images, prompts).float() for spec, reward in rewards.items()}

    def fidelities(x0: torch.Tensor) -> dict[str, dict[str, float]]:
        return {spec: fidelity(values, reference[spec], len(chosen)) for spec, values in score(x0).items()}

    n = len(prompts)
    ref_x0, ref_seconds = timed_ode(model, prompts, seeds, args.steps, args.max_batch, args.repeats)
    reference = score(ref_x0)
    _, ref_preview_seconds = timed_ode(model, prompts, seeds, args.preview_steps, args.max_batch, args.repeats)
    backends = args.backends.split(",") if args.backends else available_backends(model.device)
    print(
        f"{n} images ({len(chosen)} prompts × {args.seeds} seeds), guidance {model.guidance}, "
        f"{args.threads} thread(s); full precision = {model.dtype}; reference: full precision at {args.steps} steps; "
        f"mean reference rewards { {k: round(float(v.mean()), 3) for k, v in reference.items()} }",
        flush=True,
    )
    results = {
        "settings": vars(args),
        "images": n,
        "full_precision": {"images_per_s_full": n / ref_seconds, "images_per_s_preview": n / ref_preview_seconds},
    }
    for backend in backends:
        explorer = make_explorer(model, backend)
        preview_x0, preview_seconds = timed_ode(
            explorer.model, prompts, seeds, args.preview_steps, args.max_batch, args.repeats
        )
        full_x0, full_seconds = timed_ode(explorer.model, prompts, seeds, args.steps, args.max_batch, args.repeats)
        row = {
            "quantized_layers": len(explorer.quantized),
            "velocity_rel_error": velocity_error(model, explorer.model, prompts[:16], seeds[:16]),
            "images_per_s_preview": n / preview_seconds,
            "images_per_s_full": n / full_seconds,
            "speedup_preview_vs_fp_full": ref_seconds / preview_seconds,
            "speedup_same_steps": ref_seconds / full_seconds,
            "preview": fidelities(preview_x0),
            "full_steps": fidelities(full_x0),
        }
        results[backend] = row
        print(backend, json.dumps(row), flush=True)

    fp = results["full_precision"]
    print(
        f"\n| explorer | layers quantized | rel. ‖Δv‖ | img/s @{args.preview_steps} | img/s @{args.steps} | "
        f"× full precision @{args.steps}: preview / same steps |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| full precision ({str(model.dtype).replace('torch.', '')}) | – | 0 | {fp['images_per_s_preview']:.1f} | "
        f"{fp['images_per_s_full']:.1f} | {fp['images_per_s_preview'] / fp['images_per_s_full']:.2f} / 1.00 |"
    )
    for backend in backends:
        r = results[backend]
        print(
            f"| {backend} | {r['quantized_layers']} | {r['velocity_rel_error']:.3f} | "
            f"{r['images_per_s_preview']:.1f} | "
            f"{r['images_per_s_full']:.1f} | {r['speedup_preview_vs_fp_full']:.2f} / {r['speedup_same_steps']:.2f} |"
        )
    print(
        f"\n| reward | explorer | ρ preview @{args.preview_steps} | τ preview | top-half hit | ρ @{args.steps} | "
        f"τ @{args.steps} | prompts ranked (of {len(chosen)}) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for spec in rewards:
        for backend in backends:
            p, f = results[backend]["preview"][spec], results[backend]["full_steps"][spec]
            print(
                f"| {spec} | {backend} | {p['spearman']:.2f} | {p['kendall']:.2f} | {p['top_half_hit']:.2f} | "
                f"{f['spearman']:.2f} | {f['kendall']:.2f} | {p['groups_with_rank']:.0f} / "
                f"{f['groups_with_rank']:.0f} |"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
