"""Model metadata for the v2 protocol: a served model's signature (its tensors and
versions, and its metadata document, encoded once) and the server's metadata document."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import orjson
from trioserve import TensorSpec, UnknownModel


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
        platform = "pytorch" if type(backend).__name__ == "TorchBackend" else "python"
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
    "server_metadata",
]
