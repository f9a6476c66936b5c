"""The Megatron-vs-HF loss cases and their one worker run (tests/workers/loss_aggregation.py, two
data-parallel ranks), shared by test_loss_aggregation.py (MIPU) and test_armor_reference.py (ARMOR)."""

from types import SimpleNamespace

import pytest
import torch

from hf_reference import ReferenceOptimizer, armor_tokens, grpo_advantages, response_logprobs, warmup_lr

KL_COEF = 1e-3


@pytest.fixture(scope="session")
def mipu_case(tiny_model_factory, tmp_path_factory):
    """A tiny model, a batch of 5 responses of different lengths with old/ref/engine logprobs, and, per
    aggregation, the single-process reference: -J_S1 + 1e-3 * KL (k3) and its gradients, written out
    response by response on the HF model."""
    from transformers import AutoModelForCausalLM

    from megatron_armor.data.types import Sample
    from megatron_armor.scoring.batch import build_sequence_batch

    model_dir = tiny_model_factory()
    g = torch.Generator().manual_seed(7)
    samples = []
    for i, (prompt_len, response_len) in enumerate([(3, 9), (5, 2), (2, 6), (4, 11), (6, 4)]):
        prompt = torch.randint(1, 120, (prompt_len,), generator=g).tolist()
        response = torch.randint(1, 120, (response_len,), generator=g).tolist()
        samples.append(Sample(i, prompt, response, [0.0] * response_len, "stop", False))
    batch = build_sequence_batch(samples, [1.0, -1.0, 0.5, -0.5, 2.0], pad_token_id=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logp = torch.log_softmax(hf(batch.input_ids).logits, -1).gather(-1, batch.labels[..., None])[..., 0]
    mask = batch.response_mask
    batch.old_logprobs = (logp.detach() + 0.3 * torch.randn(logp.shape, generator=g)) * mask  # ratios beyond 1 +- 0.2
    batch.ref_logprobs = (batch.old_logprobs + 0.2 * torch.randn(logp.shape, generator=g)) * mask
    batch.engine_logprobs = (batch.old_logprobs + 0.8 * torch.randn(logp.shape, generator=g)) * mask  # w around 2
    path = tmp_path_factory.mktemp("mipu-batch") / "batch.pt"
    torch.save(batch, path)

    policy, kl = [], []  # per response: [T_i] token terms
    for i in range(batch.size):
        t = mask[i].bool()
        a = batch.advantages[i]
        wbar = (batch.old_logprobs[i, t] - batch.engine_logprobs[i, t]).exp().clamp(max=2.0)
        r = (logp[i, t] - batch.old_logprobs[i, t]).exp()
        l_clip = torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
        policy.append(-wbar * (torch.maximum(l_clip, 1.4 * a) if a < 0 else l_clip))
        d = batch.ref_logprobs[i, t] - logp[i, t]
        kl.append(d.exp() - d - 1)
    means = {
        "seq_mean_token_mean": lambda terms: torch.stack([x.mean() for x in terms]).mean(),
        "token_mean": lambda terms: torch.cat(terms).mean(),
    }
    params = dict(hf.named_parameters())
    reference = {}
    for aggregation, mean in means.items():
        policy_loss, kl_loss = mean(policy), mean(kl)
        grads = torch.autograd.grad(policy_loss + KL_COEF * kl_loss, list(params.values()), retain_graph=True)
        reference[aggregation] = {"grads": dict(zip(params, grads)), "policy_loss": policy_loss.item(),
                                  "kl_to_ref": kl_loss.item()}
    return model_dir, path, reference


# ----- ARMOR: the loss, its gradient and two RL steps of the optimizer, against float64 HF + torch.optim.AdamW ----
ARMOR_LOSS = dict(alpha=0.75, clip_low=0.2, clip_high=0.28, dual_clip=10.0)
# lr is large so that two warmup steps move the weights well beyond the float32 comparison tolerance; the
# gradient norms of this batch are ~1, so a 0.25 clip binds on every step.
ARMOR_OPTIM = dict(lr=4e-3, warmup_steps=4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
                   grad_clip=0.25)
# Two groups of 3 on-policy samples + 1 correct anchor (the last). RL step 0 takes one mini-batch per group,
# RL step 1 the whole batch as one mini-batch: three optimizer steps, at warmup rates lr/4, lr/4, lr/2.
ARMOR_REWARDS = [[1.0, -1.0, -1.0, 1.0], [1.0, 1.0, -1.5, 1.0]]  # -1.5: wrong and over-long
ARMOR_STEPS = [(0, [[0, 1, 2, 3], [4, 5, 6, 7]]), (1, [list(range(8))])]
OLD_POLICY_NOISE = 0.03  # the old policy is the actor plus this weight noise: ~10% of the tokens clip at theta_0
RHO_MARGIN = 1e-4  # no mixed ratio this close to a clip boundary, where fp32 and fp64 could take different branches


def _adam_settings():
    o = ARMOR_OPTIM
    return dict(weight_decay=o["weight_decay"], betas=(o["adam_beta1"], o["adam_beta2"]), eps=o["adam_eps"])


@pytest.fixture(scope="session")
def armor_case(tiny_model_factory, tmp_path_factory):
    """A batch of 2 groups (on-policy samples + a correct anchor) with old logprobs from an HF forward of
    the old policy and ref logprobs from a distinct reference model, as the Megatron worker gets it (old/ref
    rounded to float32, advantages from the package); and the float64 reference written from armor.md:

    - `grads`, `sums`: gradient and loss statistics of the whole batch at the initial weights theta_0;
    - `updates`: per RL step of ARMOR_STEPS, the metrics update_policy reports and the weights after it,
      from AdamW + clip_grad_norm_ on the HF model with every mini-batch's autograd gradient;
    - `steps`: per optimizer step, the gradient fed to the optimizer, its pre-clip norm, the weights after,
      and the weights an optimizer without clipping or with Megatron's 1-D exemption from decay would give.
    """
    from transformers import AutoModelForCausalLM

    from megatron_armor.algorithms import group_advantages
    from megatron_armor.data.types import Sample
    from megatron_armor.models.tiny import make_tiny_checkpoint
    from megatron_armor.scoring.batch import build_sequence_batch

    actor_dir = tiny_model_factory()
    ref_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("armor-ref"), seed=1)
    g = torch.Generator().manual_seed(11)
    samples = []
    for group, rewards in enumerate(ARMOR_REWARDS):
        prompt = torch.randint(1, 96, (3 + 2 * group,), generator=g).tolist()
        for k, reward in enumerate(rewards):
            response = torch.randint(1, 96, (5 + (3 * group + 2 * k) % 7,), generator=g).tolist()
            anchor = k == len(rewards) - 1
            samples.append(Sample(group, prompt, response, [0.0] * len(response), "stop", anchor, reward, reward > 0))

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)

    old_policy, ref_model, actor = load(actor_dir), load(ref_dir), load(actor_dir)
    with torch.no_grad():
        for p in old_policy.parameters():
            p.add_(OLD_POLICY_NOISE * torch.randn(p.shape, generator=g, dtype=p.dtype))
        # float32 as the trainer stores them; the reference uses the same rounded values
        old = [response_logprobs(old_policy, s.prompt_ids, s.response_ids).float().double() for s in samples]
        ref = [response_logprobs(ref_model, s.prompt_ids, s.response_ids).float().double() for s in samples]
    advantages = grpo_advantages([s.reward for s in samples], [s.prompt_index for s in samples])

    batch = build_sequence_batch(
        samples, group_advantages(torch.tensor([s.reward for s in samples]),
                                  torch.tensor([s.prompt_index for s in samples])).tolist(), pad_token_id=0)
    batch.old_logprobs, batch.ref_logprobs = (torch.zeros_like(batch.response_mask) for _ in range(2))
    for i in range(batch.size):
        mask = batch.response_mask[i].bool()
        batch.old_logprobs[i, mask], batch.ref_logprobs[i, mask] = old[i].float(), ref[i].float()

    params = dict(actor.named_parameters())
    init = {name: p.detach().clone() for name, p in params.items()}

    def score(rows):
        """Token terms of `rows` at the actor's current weights; sums for update_policy's metrics."""
        terms = [armor_tokens(response_logprobs(actor, samples[i].prompt_ids, samples[i].response_ids), old[i], ref[i],
                              advantages[i], **ARMOR_LOSS) for i in rows]
        rho = torch.cat([t.rho for t in terms])
        margin = torch.stack([(rho - 1 + ARMOR_LOSS["clip_low"]).abs(), (rho - 1 - ARMOR_LOSS["clip_high"]).abs()])
        assert margin.min() > RHO_MARGIN, "a mixed ratio sits on a clip boundary: pick another seed"
        loss = torch.cat([t.loss for t in terms])
        sums = {"loss/policy_loss": loss.sum().item(), "clipped": sum(int(t.clipped.sum()) for t in terms),
                "dual_clipped": sum(int(t.dual_clipped.sum()) for t in terms), "rho": rho.sum().item(),
                "tokens": len(rho)}
        return loss.mean(), sums

    # the whole batch at theta_0
    loss, sums = score(range(len(samples)))
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))

    # the RL steps, as update_policy runs them
    optimizer = ReferenceOptimizer(params, grad_clip=ARMOR_OPTIM["grad_clip"], **_adam_settings())
    updates, steps = [], []
    for rl_step, mini_batches in ARMOR_STEPS:
        lr = warmup_lr(ARMOR_OPTIM["lr"], ARMOR_OPTIM["warmup_steps"], rl_step)
        totals, norms = {}, []
        for rows in mini_batches:
            mini_loss, mini_sums = score(rows)
            for name, value in mini_sums.items():
                totals[name] = totals.get(name, 0) + value
            step_grads = dict(zip(params, torch.autograd.grad(mini_loss, list(params.values()))))
            norms.append(optimizer.step(step_grads, lr))
            steps.append({"rl_step": rl_step, "lr": lr, "grads": step_grads, "grad_norm": norms[-1],
                          "weights": {n: p.detach().clone() for n, p in params.items()}})
        metrics = {"loss/policy_loss": totals["loss/policy_loss"] / totals["tokens"],
                   "loss/clip_fraction": totals["clipped"] / totals["tokens"],
                   "loss/mixed_ratio_mean": totals["rho"] / totals["tokens"],
                   "optim/grad_norm": sum(norms) / len(norms), "optim/lr": lr}
        updates.append({"metrics": metrics, "weights": {n: p.detach().clone() for n, p in params.items()},
                        "clipped": totals["clipped"], "tokens": totals["tokens"]})

    # the same gradients through optimizers that differ from the package's in one respect
    variants = {
        "no_clip": dict(grad_clip=None),
        "megatron_1d_exempt": dict(grad_clip=ARMOR_OPTIM["grad_clip"], decay=lambda name, p: p.dim() > 1),
    }
    for variant, options in variants.items():
        weights = {n: w.clone() for n, w in init.items()}
        other = ReferenceOptimizer(weights, **options, **_adam_settings())
        for step in steps:
            other.step(step["grads"], step["lr"])
            step[variant] = {n: w.clone() for n, w in weights.items()}

    path = tmp_path_factory.mktemp("armor-case") / "case.pt"
    torch.save({"batch": batch, "loss": ARMOR_LOSS, "optim": ARMOR_OPTIM, "steps": ARMOR_STEPS,
                "injected": [(step["rl_step"], {n: t.float() for n, t in step["grads"].items()}) for step in steps]},
               path)
    return SimpleNamespace(path=path, optim=ARMOR_OPTIM, samples=samples, batch=batch, init=init, grads=grads,
                           sums=sums, updates=updates, steps=steps)


@pytest.fixture(scope="session")
def loss_workers(mipu_case, armor_case, tmp_path_factory):
    """One run of tests/workers/loss_aggregation.py on two data-parallel ranks: each rank's saved results."""
    from launcher import run_workers

    out = tmp_path_factory.mktemp("loss-workers")
    run_workers("loss_aggregation.py", 2, out, str(mipu_case[0]), str(mipu_case[1]), str(armor_case.path))
    return [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]
