"""`KVConnectorFactory`: connector name -> class, imported only when used.

`kv_transfer_config.kv_connector` names a built-in connector, or, with
`kv_connector_module_path`, a class of that name in the user's module (vLLM's way of plugging
in an out-of-tree connector).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagedllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig, KVTransferConfig

_PACKAGE = "pagedllm.distributed.kv_transfer"
# name -> (module, class). Modules load lazily: a network connector's imports are paid only
# by engines that use it.
_BUILTIN = {
    "SharedStorageConnector": (f"{_PACKAGE}.shared_storage_connector", "SharedStorageConnector"),
    "P2pZmqConnector": (f"{_PACKAGE}.p2p_zmq_connector", "P2pZmqConnector"),
    "OffloadingConnector": (f"{_PACKAGE}.offloading_connector", "OffloadingConnector"),
    "MultiConnector": (f"{_PACKAGE}.multi_connector", "MultiConnector"),
}


class KVConnectorFactory:
    @staticmethod
    def names() -> list[str]:
        return sorted(_BUILTIN)

    @staticmethod
    def get_connector_class(kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        """The class `kv_transfer_config` names; ValueError for an unknown name."""
        name = kv_transfer_config.kv_connector
        module_path = kv_transfer_config.kv_connector_module_path
        if module_path:
            module_name, class_name = module_path, name
        elif name in _BUILTIN:
            module_name, class_name = _BUILTIN[name]
        else:
            raise ValueError(
                f"kv_transfer_config.kv_connector={name!r} is not a known connector; choose "
                f"one of {KVConnectorFactory.names()} or set kv_connector_module_path"
            )
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(
                f"cannot load KV connector {class_name!r} from {module_name!r}: {e}"
            ) from e
        if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
            raise ValueError(f"{module_name}.{class_name} is not a KVConnectorBase_V1")
        return cls

    @staticmethod
    def validate(kv_transfer_config: KVTransferConfig) -> None:
        """Check the name and the connector's options without building anything."""
        KVConnectorFactory.get_connector_class(kv_transfer_config).validate_config(
            kv_transfer_config
        )

    @staticmethod
    def prepare(config: EngineConfig) -> None:
        """Resolve the connector's shared settings; call before building either role."""
        assert config.kv_transfer_config is not None
        cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
        cls.prepare_config(config.kv_transfer_config)

    @staticmethod
    def create_connector(config: EngineConfig, role: KVConnectorRole) -> KVConnectorBase_V1:
        kv_transfer_config = config.kv_transfer_config
        assert kv_transfer_config is not None
        cls = KVConnectorFactory.get_connector_class(kv_transfer_config)
        cls.validate_config(kv_transfer_config)
        return cls(config, role)
