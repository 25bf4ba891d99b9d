"""Write a copy of a GGUF model that keeps only its first K transformer blocks.

The result is a smaller, still loadable model with the same tokenizer, chat
template and embeddings: its outputs are meaningless as language, but it runs
the same kernels, which is what a backend correctness check needs (used by
scripts/cuda_check.sh to fit SmolLM2 into one transfer to a GPU machine).

    pip install gguf
    python scripts/truncate_gguf.py IN.gguf OUT.gguf --blocks 6
"""

from __future__ import annotations

import argparse
import re

import gguf


def truncate(src: str, dst: str, blocks: int) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = reader.fields[block_key].contents()
    if not 0 < blocks <= total:
        raise SystemExit(f"--blocks must be in 1..{total}")
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = blocks if field.name == block_key else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)

    def kept(name: str) -> bool:
        m = re.match(r"blk\.(\d+)\.", name)
        return m is None or int(m.group(1)) < blocks

    tensors = [t for t in reader.tensors if kept(t.name)]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    print(f"{dst}: {blocks}/{total} blocks, {len(tensors)}/{len(reader.tensors)} tensors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--blocks", type=int, required=True)
    args = ap.parse_args()
    truncate(args.src, args.dst, args.blocks)


if __name__ == "__main__":
    main()
