"""Model metadata for the v2 protocol: a served model's signature (its tensors and
versions, and its metadata document, encoded once) and the server's metadata document."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import orjson
from trioserve import TensorSpec, UnknownModel, triton_platform


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
    serving it has it: made again when a load has swapped in a copy of another
    configuration or backend (a load's config: docs/model-control.md), else the one
    made before (a lookup is two identity checks). The models named are fixed: those
    of the configuration."""

    def __init__(self, models: Mapping[str, Any]) -> None:
        self._models = models
        #: name -> (the config and backend it was made of, the signature)
        self._made: dict[str, tuple[Any, Any, ModelSignature]] = {}
        for name, served in models.items():
            self._make(name, served)

    def _make(self, name: str, served: Any) -> ModelSignature:
        sig = ModelSignature.of(served)
        self._made[name] = (served.config, served.backend, sig)
        return sig

    def __getitem__(self, name: str) -> ModelSignature:
        config, backend, sig = self._made[name]
        served = self._models[name]
        if served.config is not config or served.backend is not backend:
            return self._make(name, served)
        return sig

    def __contains__(self, name: object) -> bool:
        return name in self._made

    def __iter__(self) -> Iterator[str]:
        return iter(self._made)

    def __len__(self) -> int:
        return len(self._made)


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
