"""Moved to :mod:`lloyal.chat.format`; this name stays so that old imports
keep working (see CHANGELOG.md).

>>> import lloyal.chat.format, lloyal.chat_format
>>> lloyal.chat_format.__all__ == lloyal.chat.format.__all__
True
"""

from lloyal.chat.format import *  # noqa: F403
from lloyal.chat.format import __all__ as __all__
