"""The names ``guardtrain.monitor`` held before it was split, re-exported.

Compile counts are in :mod:`guardtrain.profiling`, batch signatures in
:mod:`guardtrain.signatures`, module fingerprints in :mod:`guardtrain.fingerprints`.
"""

from __future__ import annotations

from guardtrain.fingerprints import fingerprint_change, module_fingerprint
from guardtrain.profiling import CompileMonitor
from guardtrain.signatures import SameSignature, batch_signature, describe_signature

__all__ = [
    "CompileMonitor",
    "SameSignature",
    "batch_signature",
    "describe_signature",
    "fingerprint_change",
    "module_fingerprint",
]
