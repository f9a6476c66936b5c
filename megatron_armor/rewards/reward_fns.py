"""Every reward function of a run (`reward.train_fn`, `reward.val_fn`, `reward.audit_fns`), loaded at start-up so
that a missing module, file or function stops the run before any model loads."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.config import RewardConfig
from megatron_armor.config.builders import builds
from megatron_armor.rewards.audit import AuditVerifiers, audit_name
from megatron_armor.rewards.registry import RewardError, RewardFn, load_reward_fn


@dataclass(frozen=True)
class RewardFns:
    """The training reward, the validation reward and the audit verifiers."""

    train: RewardFn
    val: RewardFn
    audits: AuditVerifiers

    @classmethod
    def load(cls, reward: RewardConfig) -> RewardFns:
        """Load every function the section names; a RewardError names the setting that failed, or two audits
        whose metrics would share a name."""
        names = [audit_name(path) for path in reward.audit_fns]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise RewardError(f"reward.audit_fns: two audits would log as {repeated} (the metric name is "
                              f"<module or file stem>_<function>); name each audit's function or file differently")
        audits = tuple(_load(f"reward.audit_fns[{i}]", path) for i, path in enumerate(reward.audit_fns))
        return cls(train=_load("reward.train_fn", reward.train_fn),
                   val=_load("reward.val_fn", reward.val_fn or reward.train_fn),
                   audits=AuditVerifiers(tuple(names), audits))


builds(RewardConfig)(RewardFns.load)


def _load(setting: str, path: str) -> RewardFn:
    """`load_reward_fn(path)`, its error prefixed with the setting that names it."""
    try:
        return load_reward_fn(path)
    except RewardError as error:
        raise RewardError(f"{setting}: {error}") from error
