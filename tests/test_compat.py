"""Engine internals are version-checked at construction, with an error naming what to install."""

from __future__ import annotations

import pytest

from genlm_backend.llm.hf.compat import check_transformers_version
from genlm_backend.llm.vllm.compat import check_vllm_version


def test_unsupported_transformers_is_a_clear_import_error():
    check_transformers_version("5.23.0")
    with pytest.raises(ImportError, match=r"transformers >=5,<6 .*found 4\.57\.1.*pip install"):
        check_transformers_version("4.57.1")


def test_unsupported_vllm_is_a_clear_import_error():
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.1+cpu")
    with pytest.raises(ImportError, match=r"vllm >=0\.32,<0\.34 .*found 0\.10\.2.*pip install"):
        check_vllm_version("0.10.2")
    with pytest.raises(ImportError, match=r"found 1\.0\.0"):
        check_vllm_version("1.0.0")
