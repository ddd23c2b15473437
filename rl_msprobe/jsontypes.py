"""The type of parsed JSON objects (msprobe's dump.json, rl-msprobe's own records and reports).

Their values are whatever the file holds: code reading them checks each value where it uses it
(isinstance, `is_tensor`), so the values are `Any` here and nowhere else.
"""

from __future__ import annotations

from typing import Any, TypeAlias

JsonObject: TypeAlias = dict[str, Any]
