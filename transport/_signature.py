"""Model metadata for the v2 protocol: a served model's signature (its tensors and
versions, and its metadata document, encoded once) and the server's metadata document."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import orjson
from trioserve import InvalidInput, TensorSpec, UnknownModel, triton_platform


@attrs.frozen(kw_only=True)
class ModelSignature:
    """What the gateway knows of a served model: its tensors (per item) and versions,
    and its metadata document, encoded once."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    open_inputs: bool = False
    by_name: Mapping[str, TensorSpec] = attrs.field(eq=False, repr=False)
    outputs_by_name: Mapping[str, TensorSpec] = attrs.field(eq=False, repr=False)
    metadata_json: bytes = attrs.field(eq=False, repr=False)
    #: the metadata document asked for one version: that version only, as Triton's
    version_json: Mapping[str, bytes] = attrs.field(eq=False, repr=False, factory=dict)
    #: the ``Runtime.models[name]`` entry it was made of (the copy serving then),
    #: held weakly (:attr:`served`): a signature kept (:class:`Signatures`) keeps
    #: no copy alive
    _served: weakref.ref[Any] = attrs.field(eq=False, repr=False)

    @property
    def served(self) -> Any:
        """The ``Runtime.models[name]`` entry it was made of; None once that copy,
        replaced, is gone (nothing held it: no request that may have run on it
        waits for its answer)."""
        return self._served()

    @classmethod
    def of(cls, served: Any) -> ModelSignature:
        """The signature of a ``Runtime.models[name]`` entry."""
        backend = served.backend
        cfg = served.config
        platform = triton_platform(backend)
        inputs, outputs = tuple(backend.inputs), tuple(backend.outputs)

        # Every served model batches, so (as Triton reports for max_batch_size > 0) each
        # tensor's shape starts with a dynamic batch dimension.
        def tensors(specs: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
            return [
                {"name": s.name, "datatype": s.datatype, "shape": [-1, *s.shape]}
                for s in specs
            ]

        doc = {
            "name": cfg.name,
            "versions": list(cfg.versions),
            "platform": platform,
            "inputs": tensors(inputs),
            "outputs": tensors(outputs),
            "parameters": {"max_batch_size": cfg.max_batch_size},
        }
        return cls(
            name=cfg.name,
            versions=tuple(cfg.versions),
            platform=platform,
            inputs=inputs,
            outputs=outputs,
            open_inputs=bool(getattr(backend, "open_inputs", False)),
            by_name={s.name: s for s in inputs},
            outputs_by_name={s.name: s for s in outputs},
            metadata_json=orjson.dumps(doc),
            version_json={v: orjson.dumps({**doc, "versions": [v]}) for v in cfg.versions},
            served=weakref.ref(served),
        )

    def metadata(self, version: str | None) -> bytes:
        """The model's metadata document (``GET /v2/models/NAME[/versions/V]``): its
        versions, or only ``version`` when one is asked (checked served)."""
        if version is None:
            return self.metadata_json
        self.check_version(version)
        return self.version_json[version]

    def check_version(self, version: str | None) -> None:
        """Raise UnknownModel (404) when ``version`` is not served."""
        if version is not None and version not in self.versions:
            raise UnknownModel.no_version(self.name, version, self.versions)


class Signatures(Mapping[str, ModelSignature]):
    """The signature of each of a runtime's models (``Runtime.models``), as the copy
    serving it has it: made again when a load has swapped in another copy, else the
    one made before (a lookup is one identity check). The models named are fixed:
    those of the configuration.

    No signature here holds its copy (:attr:`ModelSignature.served` is weak): the
    one kept for a model whose copy a reload or an unload replaced since its last
    lookup holds nothing of it. Past its drain, what keeps a replaced copy is the
    caller of a request that looked it up here: it holds the copy (the
    ``ServedModel`` of its lookup) until the request is answered, and with it the
    copies that replaced
    it, one reload after the other (``ServedModel.successor``), any of which may
    run the request (:meth:`answering`). So a copy lives as long as a request that
    may have run on it waits for its answer, and no longer."""

    def __init__(self, models: Mapping[str, Any]) -> None:
        self._models = models
        self._made: dict[str, ModelSignature] = {}
        for name, served in models.items():
            self._made[name] = ModelSignature.of(served)
        #: the signatures of replaced copies that an answer needed, each kept while
        #: its copy lives (a key held weakly; the signature holds it weakly too)
        self._replaced: weakref.WeakKeyDictionary[Any, ModelSignature] = (
            weakref.WeakKeyDictionary()
        )

    def __getitem__(self, name: str) -> ModelSignature:
        sig = self._made[name]
        served = self._models[name]
        if served is not sig._served():  # a load swapped in another copy
            sig = self._made[name] = ModelSignature.of(served)
        return sig

    def answering(
        self,
        sig: ModelSignature,
        served: Any,
        outputs: Sequence[tuple[str, bool, int]] | None,
        results: Sequence[Mapping[str, Any]],
    ) -> ModelSignature:
        """The signature to encode ``results`` by: those of a request checked against
        ``sig``, the signature of ``served`` (the ``Runtime.models[name]`` entry the
        request looked up, which its caller holds until it is answered), which asked
        for ``outputs`` (None: all), when a reload swapped in another copy meanwhile
        (``Runtime.models[name] is not served``: the callers check that first, so
        that an answer pays one identity check for it). The request was run by the
        copy it looked up (queued before the swap), or by one that replaced it
        (handed over to it, docs/model-control.md): by ``served`` or one of the
        copies after it (``ServedModel.successor``), however many reloads came
        meanwhile. This is the signature of the one whose outputs ``results`` are
        (each copy's replicas conform what they return to its declarations); ``sig``
        itself when every one of them declares the same outputs. Raises
        InvalidInput (400) when an output asked for is one the copy that ran it
        does not have, as for an unknown output."""
        copies = [sig]
        after = getattr(served, "successor", None)
        while after is not None:
            copies.append(self._of(after))
            after = after.successor
        if all(s.outputs == sig.outputs for s in copies):
            return sig
        ran = _returned_by(copies, results[0])
        if outputs is not None and not ran.open_inputs:
            for name, _, _ in outputs:
                if name not in ran.outputs_by_name:
                    raise InvalidInput(
                        f"model {sig.name!r}: unknown output {name!r}; expected "
                        f"{', '.join(sorted(ran.outputs_by_name))} (the model was "
                        "reloaded while this request waited: it now gives "
                        f"{TensorSpec.listed(ran.outputs)})"
                    )
        return ran

    def _of(self, served: Any) -> ModelSignature:
        """The signature of ``served``, a copy of a model (one serving, or replaced),
        made once: the one kept for the model when it serves it."""
        name = served.config.name
        if self._models[name] is served:
            return self[name]
        sig = self._replaced.get(served)
        if sig is None:
            sig = self._replaced[served] = ModelSignature.of(served)
        return sig

    def __contains__(self, name: object) -> bool:
        return name in self._made

    def __iter__(self) -> Iterator[str]:
        return iter(self._made)

    def __len__(self) -> int:
        return len(self._made)


def _returned_by(
    copies: Sequence[ModelSignature], out: Mapping[str, Any]
) -> ModelSignature:
    """Which of the signatures of a model's copies, one reload after the other
    (oldest first), declares the outputs ``out`` (one item's) are: every output it
    declares present, of its dtype and a shape it accepts. When several do (one
    declares fewer outputs, or shapes the other's accept), the one declaring more of
    them, so that none the model returned of its declared outputs is left out; of
    those declaring as many, the newest."""
    newest_first = copies[::-1]
    fits = [sig for sig in newest_first if _declares(sig, out)]
    if not fits:
        # none (a model that returned what its copy does not declare cannot: its
        # replicas refuse it): the encoder says what is wrong
        return newest_first[0]
    return max(fits, key=lambda sig: -1 if sig.open_inputs else len(sig.outputs))


def _declares(sig: ModelSignature, out: Mapping[str, Any]) -> bool:
    if sig.open_inputs:
        return True
    for spec in sig.outputs:
        if spec.name not in out:
            return False
        arr = np.asarray(out[spec.name])
        dtype = spec.dtype
        if arr.dtype != dtype and not (dtype.kind == "O" and arr.dtype.kind in "SU"):
            return False
        if not spec.accepts_shape(arr.shape):
            return False
    return True


def server_metadata(version: str) -> bytes:
    return orjson.dumps(
        {
            "name": "trioserve",
            "version": version,
            "extensions": [
                "binary_tensor_data", "classification", "parameters", "schedule_policy",
                "model_configuration", "model_repository", "statistics", "stream",
            ],
        }
    )


__all__ = [
    "ModelSignature",
    "Signatures",
    "server_metadata",
]
