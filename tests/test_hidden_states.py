import pytest
import torch

from dflash_compile.models.hidden_states import AuxHiddenStates, decoder_layers
from tiny_models import FAMILIES, VOCAB, tiny_target


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_hooks_match_output_hidden_states(family):
    target = tiny_target(family)
    n = target.config.num_hidden_layers
    assert len(decoder_layers(target)) == n
    aux = AuxHiddenStates(target, [3, 0, 2, 1])  # every layer; 3 is HF's final-normed entry
    prompt = torch.randint(0, VOCAB, (2, 7))
    hs = target(prompt, output_hidden_states=True).hidden_states
    got = aux.read()
    expected = torch.cat([hs[i + 1] for i in [3, 0, 2, 1]], dim=-1)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    aux.remove()
    target(prompt)
    with pytest.raises(RuntimeError, match="no hidden states recorded"):
        aux.read()


def test_layer_ids_out_of_range():
    with pytest.raises(ValueError, match=r"\[4\] are outside the target's 4 decoder layers"):
        AuxHiddenStates(tiny_target("llama"), [0, 4])
