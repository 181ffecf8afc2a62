"""Where the C extensions must have been built: a C compiler here, and TAPE_PURE not set."""

import shutil

import pytest

from tape.protocol.extensions import PURE

where_built = pytest.mark.skipif((shutil.which("cc") is None and shutil.which("gcc") is None) or PURE,
                                 reason="no C compiler here, or TAPE_PURE hides the C extensions")
