"""The operator's actions on a model's rollout (docs/rollout.md): read its state,
promote or roll back its canary, pause and resume it, as Argo Rollouts' promote,
abort, pause and resume do, and start a new trial once the last one ended. Each is
immediate: none is a checkpoint."""

from __future__ import annotations

from typing import Any

import attrs

from ._config_checks import _key, _shown
from ._errors import ConfigError, InvalidInput

#: The longest reason a rollback by the operator may give (it is logged and kept).
MAX_REASON = 1024
#: The rollout's rule keys a started trial may override (``[models.NAME.rollout]``'s).
START_RULES = ("steps", "step_s", "min_requests", "max_error_rate", "max_latency_ratio")


class _RolloutOps:
    """The Runtime's methods for a model's rollout (``[models.NAME.rollout]``)."""

    def rollout_state(self, model: str) -> dict[str, Any]:
        """``model``'s rollout now: ``statistics()[model]["rollout"]`` (its state,
        ``paused``, versions, share, step, this step's counts, reason, events,
        shadow). Not a checkpoint. Raises UnknownModel for a model not served,
        ConfigError for one without a rollout."""
        return self._rollout_of(model).statistics()

    def promote(self, model: str) -> dict[str, Any]:
        """Promote ``model``'s canary now, whatever its step: it takes every
        unversioned request (state ``promoted``, final). Returns the new state (as
        :meth:`rollout_state`). Raises as :meth:`rollout_state`, and ConfigError
        when the rollout has no canary on trial (none, promoted or rolled back)."""
        return self._operate(model, "promote")

    def rollback(self, model: str, reason: str = "operator") -> dict[str, Any]:
        """Roll ``model``'s canary back now: share 0, state ``rolled_back`` (final),
        ``reason`` recorded and logged. Returns the new state. Raises as
        :meth:`promote`, and InvalidInput for a reason that is not a non-empty
        string of at most 1,024 characters, or not valid Unicode (a lone
        surrogate)."""
        if not isinstance(reason, str) or not reason or len(reason) > MAX_REASON:
            raise InvalidInput(
                f"a rollback's reason must be a non-empty string of at most {MAX_REASON} "
                f"characters, got {type(reason).__name__}"
                + (f" of {len(reason)}" if isinstance(reason, str) else "")
            )
        try:
            reason.encode("utf-8")  # it is kept, and answered in JSON over HTTP
        except UnicodeEncodeError as exc:
            raise InvalidInput(
                f"a rollback's reason must be valid Unicode: {exc.reason} at "
                f"character {exc.start}"
            ) from None
        return self._operate(model, "rollback", reason)

    def pause_rollout(self, model: str) -> dict[str, Any]:
        """Hold ``model``'s canary at its share and step (state ``paused``): no step
        ends until :meth:`resume_rollout`. Its outcomes are still counted and
        checked: a breach still rolls it back. Returns the new state. Raises as
        :meth:`promote`, and ConfigError when it is already paused."""
        return self._operate(model, "pause")

    def resume_rollout(self, model: str) -> dict[str, Any]:
        """Resume ``model``'s paused canary: its step goes on, the pause not counted
        in its ``step_s`` (it ends at once if it lasted long enough and has its
        answers). Returns the new state. Raises as :meth:`promote`, and ConfigError
        when it is not paused."""
        return self._operate(model, "resume")

    def start_rollout(self, model: str, *, canary: str, **rule: Any) -> dict[str, Any]:
        """Begin a new trial of ``model``'s version ``canary`` now, at its first step,
        against the version taking every unversioned request (the last trial's
        canary if it was promoted, else its stable), under the configuration's rule
        keys overridden by ``rule`` (``steps``, ``step_s``, ``min_requests``,
        ``max_error_rate``, ``max_latency_ratio``, checked as the configuration's
        are). Allowed once the last trial ended (promoted or rolled back) or when
        the rollout has no canary. Returns the new state (as :meth:`rollout_state`).
        Raises as :meth:`rollout_state`; ConfigError while a canary is on trial
        (paused or not); then InvalidInput for a ``canary`` that is not one of the
        model's versions, is that stable or the rollout's shadow, or a rule key or
        value the configuration would refuse."""
        controller = self._rollout_of(model)
        r = controller.rollout
        why = r.refusal("start")
        if why is not None:
            raise ConfigError(f"model {model!r}: cannot start a rollout: {why}")

        def bad(what: str) -> InvalidInput:
            return InvalidInput(f"model {model!r}: cannot start a rollout: {what}")

        if not isinstance(canary, str):
            raise bad(f"canary must be a version's name (a string), got {_shown(canary)}")
        versions = controller.versions
        if canary not in versions:
            raise bad(f"canary {canary!r} is not one of the model's versions "
                      f"({', '.join(versions)})")
        stable = r.target()
        if canary == stable:
            raise bad(f"canary {canary!r} is the stable version (the one taking every "
                      "unversioned request now); name another version")
        if canary == controller.shadow:
            raise bad(f"canary {canary!r} is the rollout's shadow; name another version")
        unknown = sorted(set(rule) - set(START_RULES))
        if unknown:
            raise bad(f"unknown key {unknown[0]!r}; a start may give canary, "
                      f"{', '.join(START_RULES)}")
        try:
            checked = attrs.evolve(controller.config, stable=stable, canary=canary, **rule)
        except ConfigError as exc:  # the configuration's own words: rollout.KEY: ...
            raise bad(str(exc)) from None
        controller.start(canary, {k: getattr(checked, k) for k in START_RULES})
        return controller.statistics()

    def _operate(self, model: str, action: str, reason: str | None = None) -> dict[str, Any]:
        controller = self._rollout_of(model)
        controller.operate(action, reason)
        return controller.statistics()

    def _rollout_of(self, model: str) -> Any:
        """The rollout controller of ``model`` (UnknownModel, for a model not served
        or not loaded, or ConfigError when it has no rollout)."""
        self.check_loaded(model)  # type: ignore[attr-defined]
        family = self._families.get(model)  # type: ignore[attr-defined]
        if family is None or family.controller is None:
            raise ConfigError(
                f"model {model!r} has no rollout (no [models.{_key(model)}.rollout] "
                "in its configuration)"
            )
        return family.controller
