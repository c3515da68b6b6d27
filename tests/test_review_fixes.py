"""Names that pick a table entry: an unknown one is a UserError naming it and the known ones."""

import pytest

from editing.errors import UserError
from editing.models import hf


@pytest.mark.parametrize('use', [
    lambda family: hf.load('/nonexistent', family),
    lambda family: hf.export('/nonexistent', {}, {'depth': 1}, family)], ids=['load', 'export'])
def test_an_unknown_model_family_is_named_with_the_known_ones(use):
  with pytest.raises(UserError, match=r"unknown model family 'clip'; known: \[.*'clip_vision'"):
    use('clip')
