"""Moved to :mod:`lloyal.chat.output`; this name stays so that old imports
keep working (see CHANGELOG.md).

>>> import lloyal.chat.output, lloyal.chat_output
>>> lloyal.chat_output.__all__ == lloyal.chat.output.__all__
True
"""

from lloyal.chat.output import *  # noqa: F403
from lloyal.chat.output import __all__ as __all__
