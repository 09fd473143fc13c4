"""Visual tokens into a language model: both placeholder conventions, checked against
plain per-token Python references, and a small Llama trained on a caption loss."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import random_pack, tiny_model

from moonvit_projector import (
    IGNORE_INDEX,
    MoonViTProjector,
    ProjectorConfig,
    expand_visual_tokens,
    splice_visual_tokens,
    visual_token_counts,
)

PAD, IMAGE = 0, 99
HIDDEN = 8


def features_for(counts, hidden=HIDDEN, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=gen) for n in counts]


def embed(input_ids, hidden=HIDDEN):
    """Distinct, id-dependent embeddings: row i of a fixed random table."""
    table = torch.randn(100, hidden, generator=torch.Generator().manual_seed(1))
    return table[input_ids]


def expand_ids(rows, counts):
    """Reference: compact id lists with one IMAGE per image -> one IMAGE per visual token."""
    images = iter(counts)
    return [[t for token in row for t in ([IMAGE] * next(images) if token == IMAGE else [token])] for row in rows]


def reference_expand(rows, embeds, features, labels, padding_side):
    """Reference for expand_visual_tokens, one token at a time (PAD is padding)."""
    images = iter(features)
    seqs = []
    for b, row in enumerate(rows):
        tokens = []  # (embedding, label)
        for t, token in enumerate(row):
            if token == PAD:
                continue
            if token == IMAGE:
                tokens += [(v, IGNORE_INDEX) for v in next(images)]
            else:
                tokens.append((embeds[b, t], labels[b][t]))
        seqs.append(tokens)
    length = max(len(s) for s in seqs)
    out_embeds = torch.zeros(len(rows), length, embeds.shape[-1])
    out_mask = torch.zeros(len(rows), length, dtype=torch.long)
    out_labels = torch.full((len(rows), length), IGNORE_INDEX)
    out_positions = torch.zeros(len(rows), length, dtype=torch.long)
    for b, tokens in enumerate(seqs):
        offset = length - len(tokens) if padding_side == "left" else 0
        for i, (vector, label) in enumerate(tokens):
            out_embeds[b, offset + i] = vector
            out_mask[b, offset + i] = 1
            out_labels[b, offset + i] = label
            out_positions[b, offset + i] = i
    return out_embeds, out_mask, out_labels, out_positions


# Two sequences, three images (2 in the first, 1 in the second), right-padded.
COMPACT = [
    [5, IMAGE, 6, 7, IMAGE, 8, PAD],
    [9, 10, IMAGE, 11, 12, 13, 14],
]
COUNTS = [3, 1, 6]


def test_visual_token_counts():
    assert visual_token_counts(torch.tensor([[2, 2], [4, 6], [28, 14]])) == [1, 6, 98]
    assert visual_token_counts([[4, 6]], merge_kernel_size=(1, 2)) == [12]


# ---- one placeholder per visual token (Kimi-VL) -------------------------------------


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per image"])
def test_splice_replaces_placeholders_in_reading_order(packed):
    rows = expand_ids(COMPACT, COUNTS)
    width = max(map(len, rows))
    input_ids = torch.tensor([row + [PAD] * (width - len(row)) for row in rows])
    embeds = embed(input_ids)
    features = features_for(COUNTS)
    out = splice_visual_tokens(input_ids, embeds, torch.cat(features) if packed else features, IMAGE)

    expected = embeds.clone()
    visual_rows = iter(torch.cat(features))
    for b, row in enumerate(input_ids.tolist()):
        for t, token in enumerate(row):
            if token == IMAGE:
                expected[b, t] = next(visual_rows)
    assert torch.equal(out, expected)


def test_splice_is_differentiable_and_casts_to_the_embeddings_dtype():
    input_ids = torch.tensor([[1, IMAGE, IMAGE, 2]])
    embeds = embed(input_ids).bfloat16().requires_grad_()
    features = torch.randn(2, HIDDEN, requires_grad=True)
    out = splice_visual_tokens(input_ids, embeds, features, IMAGE)
    assert out.dtype == torch.bfloat16
    weights = torch.arange(4 * HIDDEN, dtype=torch.bfloat16).reshape(1, 4, HIDDEN)
    (out * weights).sum().backward()
    assert torch.equal(features.grad, weights[0, 1:3].float())
    assert torch.equal(embeds.grad[0, [0, 3]], weights[0, [0, 3]])
    assert not embeds.grad[0, 1:3].any()


def test_splice_count_mismatch_names_the_counts_per_sequence():
    input_ids = torch.tensor([[IMAGE, IMAGE, 1], [IMAGE, 2, 3]])
    with pytest.raises(ValueError, match=r"hold 3 placeholder tokens 99 \(per sequence: \[2, 1\]\).*give 4 visual"):
        splice_visual_tokens(input_ids, embed(input_ids), torch.randn(4, HIDDEN), IMAGE)
    with pytest.raises(ValueError, match=r"per image: \[1, 1\]"):
        splice_visual_tokens(input_ids, embed(input_ids), features_for([1, 1]), IMAGE)


def test_splice_rejects_an_image_split_across_sequences():
    input_ids = torch.tensor([[IMAGE, IMAGE, 1], [IMAGE, 2, 3]])
    with pytest.raises(ValueError, match=r"straddle two sequences.*per sequence \[2, 1\].*per image \[1, 2\]"):
        splice_visual_tokens(input_ids, embed(input_ids), features_for([1, 2]), IMAGE)


def test_splice_checks_shapes():
    input_ids = torch.tensor([[IMAGE, 1]])
    with pytest.raises(ValueError, match=r"image_features\[0\] must be floating \(n, 8\).*got \(1, 5\)"):
        splice_visual_tokens(input_ids, embed(input_ids), [torch.randn(1, 5)], IMAGE)
    with pytest.raises(ValueError, match=r"inputs_embeds must be \(B, T, H\) with \(B, T\) = \(1, 2\)"):
        splice_visual_tokens(input_ids, embed(input_ids)[0], torch.randn(1, HIDDEN), IMAGE)
    with pytest.raises(ValueError, match=r"input_ids must be \(B, T\) integer"):
        splice_visual_tokens(input_ids[0], embed(input_ids), torch.randn(1, HIDDEN), IMAGE)


# ---- one placeholder per image ----------------------------------------------------


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_expand_matches_the_per_token_reference(padding_side):
    input_ids = torch.tensor(COMPACT)
    labels = torch.where(input_ids == PAD, IGNORE_INDEX, input_ids + 100)
    embeds = embed(input_ids)
    features = features_for(COUNTS)
    out = expand_visual_tokens(
        input_ids,
        embeds,
        features,
        IMAGE,
        attention_mask=(input_ids != PAD).long(),
        labels=labels,
        padding_side=padding_side,
    )
    ref_embeds, ref_mask, ref_labels, ref_positions = reference_expand(
        COMPACT, embeds, features, labels.tolist(), padding_side
    )
    assert out.inputs_embeds.shape == (2, 12, HIDDEN)  # 8 and 12 tokens
    assert torch.equal(out.inputs_embeds, ref_embeds)
    assert torch.equal(out.attention_mask, ref_mask)
    assert torch.equal(out.labels, ref_labels)
    assert torch.equal(out.position_ids, ref_positions)


def test_expand_without_mask_or_labels_keeps_every_token():
    input_ids = torch.tensor([[IMAGE, 1, 2]])
    out = expand_visual_tokens(input_ids, embed(input_ids), features_for([2]), IMAGE)
    assert out.labels is None and set(out.model_inputs()) == {"inputs_embeds", "attention_mask", "position_ids"}
    assert torch.equal(out.attention_mask, torch.ones(1, 4, dtype=torch.long))
    assert torch.equal(out.position_ids, torch.arange(4)[None])


def test_expand_and_splice_agree():
    """The same batch in both conventions gives the same embeddings."""
    compact = torch.tensor(COMPACT)
    features = features_for(COUNTS)
    expanded = expand_visual_tokens(compact, embed(compact), features, IMAGE, attention_mask=(compact != PAD).long())
    rows = expand_ids(COMPACT, COUNTS)
    width = max(map(len, rows))
    input_ids = torch.tensor([row + [PAD] * (width - len(row)) for row in rows])
    spliced = splice_visual_tokens(input_ids, embed(input_ids), features, IMAGE)
    mask = expanded.attention_mask.bool()
    assert torch.equal(mask, input_ids != PAD)
    assert torch.equal(expanded.inputs_embeds[mask], spliced[mask])


def test_expand_is_differentiable():
    input_ids = torch.tensor([[1, IMAGE, 2], [IMAGE, 3, PAD]])
    embeds = embed(input_ids).requires_grad_()
    features = [f.requires_grad_() for f in features_for([2, 3])]
    out = expand_visual_tokens(input_ids, embeds, features, IMAGE, attention_mask=(input_ids != PAD).long())
    out.inputs_embeds.sum().backward()
    assert all(torch.equal(f.grad, torch.ones_like(f)) for f in features)
    assert torch.equal(embeds.grad.sum(-1), torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]) * HIDDEN)


def test_expand_count_mismatch_names_the_counts_per_sequence():
    input_ids = torch.tensor(COMPACT)
    with pytest.raises(ValueError, match=r"hold 3 image placeholders 99 \(per sequence: \[2, 1\]\) but 2 images"):
        expand_visual_tokens(input_ids, embed(input_ids), features_for([1, 1]), IMAGE)


def test_expand_checks_arguments():
    input_ids = torch.tensor([[IMAGE, 1]])
    with pytest.raises(ValueError, match="padding_side must be"):
        expand_visual_tokens(input_ids, embed(input_ids), features_for([1]), IMAGE, padding_side="center")
    with pytest.raises(ValueError, match=r"labels must have input_ids' shape \(1, 2\), got \(1, 3\)"):
        expand_visual_tokens(input_ids, embed(input_ids), features_for([1]), IMAGE, labels=torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"image_features\[0\] must be floating \(n, 8\)"):
        expand_visual_tokens(input_ids, embed(input_ids), features_for([1], hidden=4), IMAGE)


# ---- inside a causal language model ------------------------------------------------

transformers = pytest.importorskip("transformers")

# The prompt is one image; the caption follows it. Only caption tokens carry labels.
PROMPTS = [
    [IMAGE, 11, 12, 13, 14],
    [20, IMAGE, 21, IMAGE, 22],
]
GRIDS = [(2, 4), (4, 6), (2, 2)]  # 2, 6 and 1 visual tokens


def tiny_llama():
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return transformers.LlamaForCausalLM(config).eval()


def caption_batch(encoder, projector, lm, encoder_no_grad=False):
    """(ExpandedInputs, visual tokens per image) for PROMPTS through encoder + projector."""
    pixels, grid_hws = random_pack(GRIDS)
    with torch.no_grad() if encoder_no_grad else contextlib.nullcontext():
        merged = encoder(pixels, grid_hws).merged
    features = projector(merged).split(visual_token_counts(grid_hws))
    input_ids = torch.tensor(PROMPTS)
    labels = torch.where(input_ids == IMAGE, IGNORE_INDEX, input_ids)
    embeds = lm.get_input_embeddings()(input_ids)
    return expand_visual_tokens(input_ids, embeds, features, IMAGE, labels=labels), features


def vlm(projector_type="kimi"):
    encoder = tiny_model().train()
    projector = MoonViTProjector(ProjectorConfig.for_encoder(encoder.config, 32, projector_type=projector_type))
    return encoder, projector, tiny_llama()


@pytest.mark.parametrize("projector_type", ["kimi", "mlp2x_gelu"])
def test_caption_loss_trains_projector_and_encoder(projector_type):
    encoder, projector, lm = vlm(projector_type)
    batch, _ = caption_batch(encoder, projector, lm)
    out = lm(**batch.model_inputs())

    # The loss is next-token cross-entropy over caption tokens only.
    targets = batch.labels[:, 1:]
    assert (targets != IGNORE_INDEX).sum() == 6  # 11..14, then 21 and 22
    manual = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(out.loss, manual)

    out.loss.backward()
    for name, param in [*projector.named_parameters(), *encoder.named_parameters()]:
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("how", ["requires_grad_(False)", "no_grad"])
def test_frozen_encoder_gets_no_gradient(how):
    encoder, projector, lm = vlm()
    if how == "requires_grad_(False)":
        encoder.requires_grad_(False)
    batch, _ = caption_batch(encoder, projector, lm, encoder_no_grad=how == "no_grad")
    lm(**batch.model_inputs()).loss.backward()
    assert all(p.grad is None for p in encoder.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in projector.parameters())


def test_both_conventions_give_the_same_loss():
    encoder, projector, lm = vlm()
    with torch.no_grad():
        compact, features = caption_batch(encoder, projector, lm)
        compact_loss = lm(**compact.model_inputs()).loss

        rows = expand_ids(PROMPTS, [f.shape[0] for f in features])
        width = max(map(len, rows))
        input_ids = torch.tensor([row + [PAD] * (width - len(row)) for row in rows])
        mask = (input_ids != PAD).long()
        embeds = splice_visual_tokens(input_ids, lm.get_input_embeddings()(input_ids), features, IMAGE)
        labels = torch.where((input_ids == IMAGE) | (input_ids == PAD), IGNORE_INDEX, input_ids)
        spliced_loss = lm(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(spliced_loss, compact_loss)


def test_chunks_count_their_spatial_tokens_whatever_their_frames():
    from moonvit_projector import expand_media_pads, media_prompt, video_prompt

    assert visual_token_counts(torch.tensor([[4, 4, 6], [1, 2, 2], [3, 2, 4]])) == [6, 1, 2]
    text = media_prompt() + " and " + video_prompt([0.0, 2.5])
    assert text == (
        "<|media_begin|>image<|media_content|><|media_pad|><|media_end|> and "
        "00:00:00.000<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"
        "00:00:02.500<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"
    )
    expanded = expand_media_pads(text, [[1, 2, 4], [4, 4, 4], [2, 2, 2]])
    assert [part.count("<|media_pad|>") for part in expanded.split("<|media_content|>")[1:]] == [2, 4, 1]
    with pytest.raises(ValueError, match="holds 3 <\\|media_pad\\|> placeholders for 2 items"):
        expand_media_pads(text, [[2, 2], [2, 2]])


def test_k3_s_image_markers_carry_the_original_size_from_the_manifest():
    from moonvit_projector import expand_media_pads, k3_image_prompt, k3_media_prompts

    assert k3_image_prompt(640, 480) == "<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_end|>"
    records = [  # manifest.jsonl lines: an image scaled down to its budget, then a video's chunk
        {"id": "big.jpg", "size": [4000, 3000], "resized": [2936, 2202], "grid_hw": [158, 210], "num_tokens": 8295},
        {"id": "v.mp4#1", "size": [64, 48], "grid_hw": [4, 6], "video_id": "v.mp4", "chunk": 1, "timestamp": 0.5,
         "frames": 4},
    ]  # fmt: skip
    prompts = k3_media_prompts(records)
    assert prompts == [
        "<|media_begin|>image 4000x3000<|media_content|><|media_pad|><|media_end|>",  # the upload, not the grid
        "00:00:00.500<|media_begin|>video<|media_content|><|media_pad|><|media_end|>",
    ]
    expanded = expand_media_pads("".join(prompts), [[1, 158, 210], [4, 4, 6]])
    assert expanded.count("<|media_pad|>") == 158 * 210 // 4 + 6
    with pytest.raises(ValueError, match="manifest record 'x.png' has no size"):
        k3_media_prompts([{"id": "x.png", "grid_hw": [2, 2]}])
    with pytest.raises(ValueError, match="width must be a positive int"):
        k3_image_prompt(0, 10)
