"""Shared by the head tests: a padded batch and weights large enough that a wrong token shows."""

import torch

PAD = 0


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Norm weights around 1, every other tensor normal(0, 0.3), from `seed`; the model in eval mode."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param)
            )
    return model.eval()


def padded_batch(vocab: int, seq: int = 11) -> torch.Tensor:
    """Four rows: full, right padded (7 real tokens), left padded (the last 4 real), one real token;
    no real token is `PAD`."""
    ids = torch.randint(1, vocab, (4, seq), generator=torch.Generator().manual_seed(3))
    ids[1, 7:] = PAD
    ids[2, : seq - 4] = PAD
    ids[3, 1:] = PAD
    return ids
