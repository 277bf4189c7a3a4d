import streamrec
from streamrec.errors import ConfigError, StreamrecError


def test_version_and_error_hierarchy() -> None:
    assert streamrec.__version__.count(".") == 2
    assert issubclass(ConfigError, StreamrecError)
