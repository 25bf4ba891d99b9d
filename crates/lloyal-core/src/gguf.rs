//! A bounded reader for the GGUF header, run before llama.cpp sees a file.
//!
//! llama.cpp parses the header itself and rejects most damage with an error,
//! but a few hyper-parameters it only *asserts* on while loading
//! (`block_count` of 0 or above 512, expert counts that do not add up, an
//! unknown RoPE scaling type): a bad value there aborts the whole process.
//! `check_header` reads the key/value section with every length checked
//! against the bytes left in the file, so a forged count or length can
//! neither allocate nor loop without bound, and checks those values first.
//! It never reads tensor data and never panics, whatever the bytes.

use std::collections::HashMap;
use std::io::{BufReader, Read, Seek};

/// `LLAMA_MAX_LAYERS` in the vendored llama.cpp.
pub const MAX_LAYERS: u64 = 512;
/// `LLAMA_MAX_EXPERTS` in the vendored llama.cpp.
pub const MAX_EXPERTS: u64 = 1024;
/// Longest key llama.cpp's own header reader accepts is far shorter; this
/// only bounds what we keep in memory.
const MAX_KEY_BYTES: u64 = 65_536;
/// String values longer than this are skipped, not kept (chat templates and
/// tokenizer data can be large; none of the checked values are strings that long).
const MAX_KEPT_STRING: u64 = 4_096;

/// One value of the header, reduced to what the checks need.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    Str(String),
    /// A string too long to keep.
    LongStr,
    /// An array: its length and, for integer arrays, the largest element.
    Array {
        len: u64,
        max_int: Option<i128>,
    },
}

/// The parsed key/value section.
#[derive(Debug, Clone, Default)]
pub struct Header {
    pub version: u32,
    pub n_tensors: u64,
    pub kv: HashMap<String, Value>,
    /// Each key's GGUF type id (4: u32, 6: f32, 8: string, 9: array, ...):
    /// llama.cpp *asserts* on the type of some keys it reads.
    pub types: HashMap<String, u32>,
}

impl Header {
    pub(crate) fn int(&self, key: &str) -> Option<i128> {
        match self.kv.get(key)? {
            Value::Int(v) => Some(*v),
            _ => None,
        }
    }

    /// A per-layer value that may be a scalar or an array (its maximum).
    fn int_or_max(&self, key: &str) -> Option<i128> {
        match self.kv.get(key)? {
            Value::Int(v) => Some(*v),
            Value::Array { max_int, .. } => *max_int,
            _ => None,
        }
    }

    pub(crate) fn string(&self, key: &str) -> Option<&str> {
        match self.kv.get(key)? {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Why a header was refused. The message is shown to the user as is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderError(pub String);

type Res<T> = std::result::Result<T, HeaderError>;

fn bad<T>(message: impl Into<String>) -> Res<T> {
    Err(HeaderError(message.into()))
}

struct Reader<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> Res<[u8; N]> {
        let mut buf = [0u8; N];
        self.take(N as u64, "header")?;
        self.inner
            .read_exact(&mut buf)
            .or_else(|_| bad("the file ends inside its header"))?;
        Ok(buf)
    }

    /// Account for `n` bytes about to be read; refuse when the file is shorter.
    fn take(&mut self, n: u64, what: &str) -> Res<()> {
        if n > self.left {
            return bad(format!(
                "{what} claims {n} bytes but only {} are left in the file",
                self.left
            ));
        }
        self.left -= n;
        Ok(())
    }

    fn u32(&mut self) -> Res<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Res<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// A length-prefixed string; kept when at most `keep` bytes long.
    fn string(&mut self, keep: u64, what: &str) -> Res<Option<String>> {
        let len = self.u64()?;
        self.take(len, what)?;
        if len > keep {
            let copied = std::io::copy(&mut (&mut self.inner).take(len), &mut std::io::sink())
                .or_else(|_| bad("the file ends inside its header"))?;
            return if copied == len {
                Ok(None)
            } else {
                bad("the file ends inside its header")
            };
        }
        let mut buf = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut buf)
            .or_else(|_| bad("the file ends inside its header"))?;
        Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
    }

    fn scalar(&mut self, ty: u32) -> Res<Value> {
        Ok(match ty {
            0 => Value::Int(self.bytes::<1>()?[0] as i128),
            1 => Value::Int(i8::from_le_bytes(self.bytes()?) as i128),
            2 => Value::Int(u16::from_le_bytes(self.bytes()?) as i128),
            3 => Value::Int(i16::from_le_bytes(self.bytes()?) as i128),
            4 => Value::Int(self.u32()? as i128),
            5 => Value::Int(i32::from_le_bytes(self.bytes()?) as i128),
            6 => Value::Float(f32::from_le_bytes(self.bytes()?) as f64),
            7 => Value::Bool(self.bytes::<1>()?[0] != 0),
            8 => match self.string(MAX_KEPT_STRING, "a string value")? {
                Some(s) => Value::Str(s),
                None => Value::LongStr,
            },
            10 => Value::Int(self.u64()? as i128),
            11 => Value::Int(i64::from_le_bytes(self.bytes()?) as i128),
            12 => Value::Float(f64::from_le_bytes(self.bytes()?)),
            other => return bad(format!("unknown GGUF value type {other}")),
        })
    }

    fn value(&mut self, ty: u32) -> Res<Value> {
        if ty != 9 {
            return self.scalar(ty);
        }
        let item = self.u32()?;
        let len = self.u64()?;
        let min_size = match item {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => return bad("nested GGUF arrays are not supported"),
            other => return bad(format!("unknown GGUF array item type {other}")),
        };
        // Every item needs at least `min_size` bytes: a forged length fails
        // here, before the loop, instead of spinning through billions of items.
        if len.checked_mul(min_size).is_none_or(|n| n > self.left) {
            return bad(format!(
                "an array claims {len} items but only {} bytes are left in the file",
                self.left
            ));
        }
        let mut max_int: Option<i128> = None;
        for _ in 0..len {
            if let Value::Int(v) = self.scalar(item)? {
                max_int = Some(max_int.map_or(v, |m| m.max(v)));
            }
        }
        Ok(Value::Array { len, max_int })
    }
}

/// Read the header's key/value section from `file` (positioned at byte 0).
pub fn read_header<R: Read + Seek>(file: R) -> Res<Header> {
    let mut file = file;
    let size = file
        .seek(std::io::SeekFrom::End(0))
        .and_then(|n| file.rewind().map(|()| n))
        .or_else(|e| bad(format!("cannot read the file: {e}")))?;
    parse(BufReader::new(file), size)
}

/// Parse a header from `source`, whose total size is `size` bytes.
pub fn parse(source: impl Read, size: u64) -> Res<Header> {
    let mut r = Reader {
        inner: source,
        left: size,
    };
    parse_kv(&mut r)
}

/// One tensor's description in a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Its dimensions, innermost first (ggml's `ne`).
    pub ne: Vec<u64>,
    /// ggml's type id (0: F32).
    pub ty: u32,
    /// Where its data starts, counted from [`Tensors::data_start`].
    pub offset: u64,
}

/// The header and tensor descriptions of a GGUF file.
#[derive(Debug, Clone)]
pub struct Tensors {
    pub header: Header,
    pub tensors: Vec<TensorInfo>,
    /// Byte offset of the data section in the file.
    pub data_start: u64,
    /// The file's size in bytes.
    pub size: u64,
}

impl Tensors {
    /// Whether `info`'s data ends inside the file, for the plain float
    /// types (quantized ones llama.cpp bounds itself; only their element
    /// count is checked here).
    pub fn fits_in_file(&self, info: &TensorInfo) -> bool {
        let n = info.ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let bytes = |n: u64| match info.ty {
            0 => n.checked_mul(4),
            1 | 30 => n.checked_mul(2),
            _ => None,
        };
        match n.and_then(bytes) {
            Some(bytes) => self
                .data_start
                .checked_add(info.offset)
                .and_then(|s| s.checked_add(bytes))
                .is_some_and(|end| end <= self.size),
            None => n.is_some(),
        }
    }
}

/// Read the header and every tensor description from `file` (at byte 0),
/// with the same bounds on every count and length as [`read_header`].
pub fn read_tensors<R: Read + Seek>(file: R) -> Res<Tensors> {
    let mut file = file;
    let size = file
        .seek(std::io::SeekFrom::End(0))
        .and_then(|n| file.rewind().map(|()| n))
        .or_else(|e| bad(format!("cannot read the file: {e}")))?;
    let mut r = Reader {
        inner: BufReader::new(file),
        left: size,
    };
    let header = parse_kv(&mut r)?;
    let mut tensors = Vec::new();
    for _ in 0..header.n_tensors {
        let name = r
            .string(MAX_KEY_BYTES, "a tensor name")?
            .ok_or_else(|| HeaderError("a tensor name is too long".into()))?;
        let n_dims = r.u32()?;
        if !(1..=4).contains(&n_dims) {
            return bad(format!(
                "tensor {name:?} has {n_dims} dimensions (1 to 4 are valid)"
            ));
        }
        let ne = (0..n_dims).map(|_| r.u64()).collect::<Res<Vec<u64>>>()?;
        let ty = r.u32()?;
        let offset = r.u64()?;
        tensors.push(TensorInfo {
            name,
            ne,
            ty,
            offset,
        });
    }
    let alignment = match header.int("general.alignment") {
        Some(a) if a > 0 && (a as u64).is_power_of_two() => a as u64,
        Some(a) => return bad(format!("general.alignment is {a}, not a power of two")),
        None => 32,
    };
    let end = size - r.left;
    let data_start = end.div_ceil(alignment) * alignment;
    Ok(Tensors {
        header,
        tensors,
        data_start,
        size,
    })
}

fn parse_kv<R: Read>(r: &mut Reader<R>) -> Res<Header> {
    if &r.bytes::<4>()? != b"GGUF" {
        return bad("not a GGUF file (missing GGUF magic bytes)");
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return bad(format!("unsupported GGUF version {version} (2 and 3 are)"));
    }
    let n_tensors = r.u64()?;
    let n_kv = r.u64()?;
    // A key/value pair takes at least 8 (key length) + 4 (type) + 1 bytes.
    if n_kv.checked_mul(13).is_none_or(|n| n > r.left) {
        return bad(format!(
            "the header claims {n_kv} metadata entries, more than the file can hold"
        ));
    }
    // A tensor description takes at least 8 + 4 + 4 + 8 bytes.
    if n_tensors.checked_mul(24).is_none_or(|n| n > r.left) {
        return bad(format!(
            "the header claims {n_tensors} tensors, more than the file can hold"
        ));
    }
    let mut kv = HashMap::new();
    let mut types = HashMap::new();
    for _ in 0..n_kv {
        let key = r
            .string(MAX_KEY_BYTES, "a metadata key")?
            .ok_or_else(|| HeaderError("a metadata key is too long".into()))?;
        let ty = r.u32()?;
        let value = r.value(ty)?;
        types.insert(key.clone(), ty);
        kv.insert(key, value);
    }
    Ok(Header {
        version,
        n_tensors,
        kv,
        types,
    })
}

/// The hyper-parameters llama.cpp asserts on while loading, checked first.
pub fn check_hparams(h: &Header) -> Res<()> {
    let Some(arch) = h.string("general.architecture") else {
        return bad("general.architecture is missing");
    };
    let key = |name: &str| format!("{arch}.{name}");
    let layers_key = key("block_count");
    let Some(layers) = h.int(&layers_key) else {
        // Vocab-only and CLIP files have no block count; llama.cpp reports
        // a missing required key as an error, not an abort.
        return Ok(());
    };
    if !(1..=MAX_LAYERS as i128).contains(&layers) {
        return bad(format!(
            "{layers_key} is {layers}; llama.cpp supports 1 to {MAX_LAYERS} layers"
        ));
    }
    let nextn = h.int(&key("nextn_predict_layers")).unwrap_or(0);
    if nextn < 0 || nextn > layers {
        return bad(format!(
            "{arch}.nextn_predict_layers is {nextn}, more than the {layers} layers"
        ));
    }
    let experts = h.int(&key("expert_count")).unwrap_or(0);
    let used = h.int_or_max(&key("expert_used_count")).unwrap_or(0);
    let groups = h.int(&key("expert_group_count")).unwrap_or(0);
    let groups_used = h.int(&key("expert_group_used_count")).unwrap_or(0);
    let consistent = if !(0..=MAX_EXPERTS as i128).contains(&experts) || used < 0 || used > experts
    {
        false
    } else if experts > 0 {
        used > 0
            && (0..experts).contains(&groups)
            && (groups <= 1 || (experts % groups == 0 && groups_used > 0 && groups_used < groups))
    } else {
        used == 0 && groups == 0
    };
    if !consistent {
        return bad(format!(
            "inconsistent expert counts: {arch}.expert_count={experts}, expert_used_count={used}, \
             expert_group_count={groups}, expert_group_used_count={groups_used} \
             (at most {MAX_EXPERTS} experts)"
        ));
    }
    for per_layer in [
        "attention.head_count",
        "attention.head_count_kv",
        "feed_forward_length",
    ] {
        if let Some(Value::Array { len, .. }) = h.kv.get(&key(per_layer)) {
            if *len > MAX_LAYERS {
                return bad(format!(
                    "{arch}.{per_layer} has {len} entries; at most {MAX_LAYERS} layers are supported"
                ));
            }
        }
    }
    if let Some(kind) = h.kv.get(&key("rope.scaling.type")) {
        let known = ["none", "linear", "yarn", "longrope"];
        match kind {
            Value::Str(s) if known.contains(&s.as_str()) => {}
            Value::Str(s) => {
                return bad(format!(
                    "{arch}.rope.scaling.type is {s:?}; llama.cpp knows {known:?}"
                ))
            }
            _ => return bad(format!("{arch}.rope.scaling.type is not a known string")),
        }
    }
    Ok(())
}

/// A GGUF header writer for tests and fuzz targets. Not part of the API.
#[doc(hidden)]
pub mod build {
    /// A metadata value.
    #[derive(Debug, Clone, Copy)]
    pub enum V<'a> {
        U32(u32),
        F32(f32),
        Bool(bool),
        Str(&'a str),
        U32s(&'a [u32]),
        F32s(&'a [f32]),
    }

    /// A GGUF v3 header with these key/value pairs and no tensors.
    pub fn header(kv: &[(&str, V<'_>)]) -> Vec<u8> {
        with_tensors(kv, &[])
    }

    /// A GGUF v3 file with these key/value pairs and f32 tensors (name,
    /// dimensions innermost first, values), aligned to 32 bytes.
    pub fn file(kv: &[(&str, V<'_>)], tensors: &[(&str, &[u64], &[f32])]) -> Vec<u8> {
        let mut b = with_tensors(kv, tensors);
        let pad = |b: &mut Vec<u8>| b.resize(b.len().div_ceil(32) * 32, 0);
        pad(&mut b);
        for (_, _, data) in tensors {
            data.iter().for_each(|x| b.extend(x.to_le_bytes()));
            pad(&mut b);
        }
        b
    }

    fn with_tensors(kv: &[(&str, V<'_>)], tensors: &[(&str, &[u64], &[f32])]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend((kv.len() as u64).to_le_bytes());
        let string = |b: &mut Vec<u8>, s: &str| {
            b.extend((s.len() as u64).to_le_bytes());
            b.extend(s.as_bytes());
        };
        for (k, v) in kv {
            string(&mut b, k);
            match v {
                V::U32(x) => {
                    b.extend(4u32.to_le_bytes());
                    b.extend(x.to_le_bytes());
                }
                V::F32(x) => {
                    b.extend(6u32.to_le_bytes());
                    b.extend(x.to_le_bytes());
                }
                V::Bool(x) => {
                    b.extend(7u32.to_le_bytes());
                    b.push(u8::from(*x));
                }
                V::Str(s) => {
                    b.extend(8u32.to_le_bytes());
                    string(&mut b, s);
                }
                V::U32s(xs) => {
                    b.extend(9u32.to_le_bytes());
                    b.extend(4u32.to_le_bytes());
                    b.extend((xs.len() as u64).to_le_bytes());
                    xs.iter().for_each(|x| b.extend(x.to_le_bytes()));
                }
                V::F32s(xs) => {
                    b.extend(9u32.to_le_bytes());
                    b.extend(6u32.to_le_bytes());
                    b.extend((xs.len() as u64).to_le_bytes());
                    xs.iter().for_each(|x| b.extend(x.to_le_bytes()));
                }
            }
        }
        let mut offset = 0u64;
        for (name, ne, data) in tensors {
            string(&mut b, name);
            b.extend((ne.len() as u32).to_le_bytes());
            ne.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(0u32.to_le_bytes());
            b.extend(offset.to_le_bytes());
            offset += (data.len() as u64 * 4).div_ceil(32) * 32;
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::build::{header, V};
    use super::*;

    fn check(bytes: &[u8]) -> Res<Header> {
        let h = parse(bytes, bytes.len() as u64)?;
        check_hparams(&h)?;
        Ok(h)
    }

    fn llama(extra: &[(&str, V)]) -> Res<Header> {
        let mut kv = vec![("general.architecture", V::Str("llama"))];
        kv.extend(extra.iter().map(|(k, v)| (*k, *v)));
        check(&header(&kv))
    }

    #[test]
    fn accepts_a_plain_header() {
        let h = llama(&[
            ("llama.block_count", V::U32(30)),
            ("llama.attention.head_count", V::U32s(&[9; 30])),
            ("llama.rope.scaling.type", V::Str("linear")),
        ])
        .unwrap();
        assert_eq!(h.int("llama.block_count"), Some(30));
        assert_eq!(h.int_or_max("llama.attention.head_count"), Some(9));
    }

    #[test]
    fn refuses_the_values_llama_cpp_asserts_on() {
        for bad_layers in [0, 513, u32::MAX] {
            let e = llama(&[("llama.block_count", V::U32(bad_layers))]).unwrap_err();
            assert!(e.0.contains("block_count"), "{e:?}");
        }
        let e = llama(&[
            ("llama.block_count", V::U32(4)),
            ("llama.expert_used_count", V::U32(2)),
        ])
        .unwrap_err();
        assert!(e.0.contains("expert"), "{e:?}");
        let e = llama(&[
            ("llama.block_count", V::U32(4)),
            ("llama.rope.scaling.type", V::Str("spiral")),
        ])
        .unwrap_err();
        assert!(e.0.contains("rope.scaling.type"), "{e:?}");
        let e = llama(&[
            ("llama.block_count", V::U32(4)),
            ("llama.attention.head_count", V::U32s(&[1; 600])),
        ])
        .unwrap_err();
        assert!(e.0.contains("600 entries"), "{e:?}");
    }

    #[test]
    fn forged_counts_and_lengths_fail_before_any_allocation() {
        let mut b = header(&[("general.architecture", V::Str("llama"))]);
        // n_kv = u64::MAX
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(check(&b).unwrap_err().0.contains("metadata entries"));
        let mut b = header(&[("general.architecture", V::Str("llama"))]);
        // the key's length
        b[24..32].copy_from_slice(&(1u64 << 62).to_le_bytes());
        assert!(check(&b).unwrap_err().0.contains("left in the file"));
        let mut b = header(&[("k", V::U32s(&[1, 2]))]);
        let at = b.len() - 8 - 8;
        b[at..at + 8].copy_from_slice(&(1u64 << 61).to_le_bytes());
        assert!(check(&b).unwrap_err().0.contains("array claims"));
        // Every truncation of a valid header is an error, never a panic.
        let full = header(&[
            ("general.architecture", V::Str("llama")),
            ("llama.block_count", V::U32(2)),
        ]);
        for n in 0..full.len() {
            assert!(check(&full[..n]).is_err(), "prefix of {n} bytes");
        }
    }
}
