"""The Runtime's model control methods: load, unload, and a model's state and config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from ._control import ModelControl
from ._errors import ConfigError, Overloaded, UnknownModel
from ._model_state import ModelState
from ._not_loaded import not_loaded
from ._triton_config import triton_config, triton_platform


class _Control:
    """The Runtime's model control methods (``load_model``, ``unload_model``)."""

    #: the model control (None: ``server.model_control = "none"``); set by the assembly
    _control: ModelControl | None = None

    async def load_model(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        """Load ``model`` (one of the configuration's), or reload it if it is loaded:
        a new copy is started and made ready, then takes the new requests, then the
        old copy drains (the requests it holds are answered by it). Returns once the
        new copy serves. Two loads of a model at once (of the same configuration)
        share one; loads and unloads of a model are serialized. A checkpoint;
        cancelling it leaves the load under way.

        ``config``: keys of the model's ``[models.NAME]`` table that this load runs
        with instead of the configuration's (those of one copy: replicas, batching,
        timers, options; docs/model-control.md), or Triton's model configuration
        (as ``GET /v2/models/NAME/config`` gives it, edited), read back into them; a
        later load without it goes back to the table.

        Raises ConfigError (model control is off, or ``config`` refused: a key
        unknown or not one a load may change, or a bad value; nothing is loaded
        then), UnknownModel (not configured), ModelLoadError (it failed to load: the
        model keeps what it had; or an unload asked before it ended abandoned it),
        ActorClosed.
        """
        try:
            control = self._controlled("load", model)
        except ConfigError:
            await trio.lowlevel.checkpoint()  # a refusal still yields
            raise
        await control.load(model, config)

    async def unload_model(self, model: str) -> None:
        """Unload ``model``: from now on its requests get UnknownModel (not loaded);
        those admitted are answered; then its replicas are closed and their workers
        or models released. Returns then. Unloading a model not loaded does nothing;
        a load still to end (the model's first load, or a reload: the copy that
        served meanwhile is unloaded) is abandoned (its callers get ModelLoadError),
        not waited for.
        A checkpoint; cancelling it leaves the unload under way. Raises as
        :meth:`load_model` (but ModelLoadError)."""
        try:
            control = self._controlled("unload", model)
        except ConfigError:
            await trio.lowlevel.checkpoint()  # a refusal still yields
            raise
        await control.unload(model)

    def check_loaded(self, model: str) -> None:
        """Raise UnknownModel unless ``model`` is served and loaded (under explicit
        model control, a configured model may not be; one whose first load is under
        way: Overloaded, 503, to retry shortly). Not a checkpoint."""
        if not self._known(model, None).loaded:  # type: ignore[attr-defined]
            raise self._not_loaded(model)

    def _not_loaded(self, model: str) -> UnknownModel | Overloaded:
        """What a request for ``model``, configured and not loaded, gets now: as its
        state says (loading, unloading or not loaded: :func:`not_loaded`)."""
        if self._control is None:
            return not_loaded(model)
        return self._control.refusal(model)

    def triton_config(self, model: str, version: str | None = None) -> dict[str, Any]:
        """``model``'s configuration as Triton's ``ModelConfig`` document, as ``GET
        /v2/models/NAME[/versions/V]/config`` answers it (``tritonclient``'s
        ``get_model_config``): the copy serving it (a version with weights of its
        own: that version's platform, backend, tensors and replicas, where Triton,
        one configuration a model, gives every version the model's). The model's
        document (no ``version``) is the version's its unversioned requests go to
        (the latest, the rollout's stable, or its canary once promoted), and,
        edited, is a load's config (docs/model-control.md). Not a checkpoint.
        Raises UnknownModel for a model or version not served, or a model not
        loaded."""
        self.check_loaded(model)
        served = self._probed(model, version)  # type: ignore[attr-defined]
        classes = [c.name for c in self.config.classes]  # type: ignore[attr-defined]
        return triton_config(served, triton_platform(served.backend), classes)

    def model_state(self, model: str) -> tuple[str, str]:
        """``model``'s state and why, as Triton's repository index gives them:
        READY, UNAVAILABLE, LOADING or UNLOADING, and a reason ("" when ready, but
        while it reloads: the loaded copy serves meanwhile, READY; and for a copy
        loaded with a config of its own: the keys it changed).
        UnknownModel for a model not configured."""
        if self._control is None:
            self._known(model, None)  # type: ignore[attr-defined]
            state, reason = ModelState.READY, ""
        else:
            state, reason = self._control.state(model)
        if self.closed:  # type: ignore[attr-defined]
            return ModelState.UNAVAILABLE.value, "the runtime is shut down"
        if state is ModelState.READY and not self.model_ready(model):  # type: ignore[attr-defined]
            return ModelState.UNAVAILABLE.value, "no replica ready"
        return state.value, reason

    def _controlled(self, action: str, model: str) -> ModelControl:
        if self._control is None:
            raise ConfigError(
                f"cannot {action} model {model!r}: model control is off "
                '(server.model_control = "none"): the models served are the '
                "configuration's, loaded at start"
            )
        return self._control
