from pathlib import Path

import numpy as np
import torch
from helpers import tiny_model
from PIL import Image

from moonvit_eval.pictures import main, position_similarity, resampled_table

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


def test_position_similarity_is_the_cosine_of_every_pair_of_positions():
    table = torch.randn(3, 5, 8, dtype=torch.float64)
    sim = position_similarity(table)
    assert sim.shape == (3, 5, 3, 5)
    flat = table.reshape(15, 8)
    for a in (0, 7, 14):
        for b in (0, 3, 14):
            expected = torch.nn.functional.cosine_similarity(flat[a], flat[b], dim=0)
            assert abs(sim.reshape(15, 15)[a, b].item() - expected.item()) < 1e-6
    assert torch.allclose(sim.reshape(15, 15).diagonal(), torch.ones(15))


def test_pictures_cli_writes_a_png_of_a_checkpoint_table(tmp_path, capsys):
    tiny_model(init_pos_emb_height=6, init_pos_emb_width=6).save_pretrained(tmp_path / "ckpt")
    main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "sim.png"), "--stride", "2"])
    assert (tmp_path / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out
    main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "grid.png"), "--grid", "3", "4"])
    assert (tmp_path / "grid.png").is_file()


def test_the_readme_command_writes_a_default_file_with_its_whole_title(tmp_path, monkeypatch):
    """``python -m moonvit_eval.pictures --checkpoint checkpoints/fm-supervised --grid 4 4`` needs no --out, and the
    default title, wider than a 4 x 4 picture, wraps: no ink touches the picture's edges."""
    monkeypatch.chdir(tmp_path)
    main(["--checkpoint", str(CHECKPOINTS / "fm-supervised"), "--grid", "4", "4"])
    picture = np.asarray(
        Image.open(tmp_path / "outputs/pictures/fm-supervised-position-similarity-4x4.png").convert("L")
    )
    ink = picture < 128
    assert not ink[:, 0].any() and not ink[:, -1].any() and not ink[0].any()
    title_rows = np.flatnonzero(ink.any(axis=1))
    assert title_rows[0] < picture.shape[0] * 0.2  # the title is drawn, above the maps


def test_the_resampled_table_is_what_the_encoder_adds():
    """At the table's own size the bicubic resampling is the identity; elsewhere it is the forward's."""
    model = tiny_model(init_pos_emb_height=6, init_pos_emb_width=6)
    assert torch.allclose(resampled_table(model, 6, 6), model.patch_embed.pos_emb.weight.detach(), atol=1e-6)
    grid = model.prepare_grid(torch.tensor([[4, 2]]))
    expected = model.patch_embed.pos_emb(grid.pos_emb_index, grid.pos_emb_weight).detach()
    assert torch.allclose(resampled_table(model, 4, 2).reshape(8, -1), expected)
