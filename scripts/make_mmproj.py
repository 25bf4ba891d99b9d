"""Draft: a random 'mlp' (llava-style) projector for SmolLM2 (written with gguf-py)."""
import sys
import numpy as np
import gguf

def write(out, n_text=576, S=16, P=8, E=16, F=16, H=16, blocks=2, seed=29):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out, "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "mlp")
    for key, value in [("embedding_length", E), ("attention.head_count", 2), ("feed_forward_length", F),
                       ("block_count", blocks), ("projection_dim", n_text), ("image_size", S), ("patch_size", P)]:
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    f = lambda *shape, sd=0.1: rng.normal(0, sd, shape).astype(np.float32)
    n = (S // P) ** 2
    w.add_tensor("v.patch_embd.weight", f(E, 3, P, P))
    w.add_tensor("v.position_embd.weight", f(n, E))
    for i in range(blocks):
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"v.blk.{i}.{t}.weight", f(E, E))
        w.add_tensor(f"v.blk.{i}.ln1.weight", np.ones(E, np.float32))
        w.add_tensor(f"v.blk.{i}.ln1.bias", np.zeros(E, np.float32))
        w.add_tensor(f"v.blk.{i}.ln2.weight", np.ones(E, np.float32))
        w.add_tensor(f"v.blk.{i}.ln2.bias", np.zeros(E, np.float32))
        w.add_tensor(f"v.blk.{i}.ffn_up.weight", f(F, E))
        w.add_tensor(f"v.blk.{i}.ffn_down.weight", f(E, F))
    w.add_tensor("mm.0.weight", f(H, E)); w.add_tensor("mm.0.bias", f(H))
    w.add_tensor("mm.2.weight", f(n_text, H, sd=0.5)); w.add_tensor("mm.2.bias", f(n_text))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

write(sys.argv[1])
