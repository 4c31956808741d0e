//! mpsd's wire format without Python: msgpack bodies read token by token and built into values by a
//! `Builder` (Python objects in `python_wire.rs`, a plain enum in the tests), and the primitives that write
//! them. The rules are those `mpsd_protocol` held msgpack-python to (`unpackb(raw=False, strict_map_key=True)`
//! with every length limited to the frame limit): map keys are str or bytes, extension types are refused, no
//! bytes may follow the body, and nesting is bounded. Integers are what msgpack carries: i64 and u64.
//! The writers choose the formats msgpack-python's `Packer(use_bin_type=True)` chooses, byte for byte, so a
//! raw peer's frames and ours are the same bytes.

use std::fmt;

/// Containers (arrays and maps) one value may hold inside one another, the message's own array included:
/// msgpack-python's unpacker stack, which mpsd's peers were held to before, so a value deep enough to be a
/// bad argument (the daemon answers it with a CUDA error: tests/test_hostile_input.py sends 1000 deep) is still a
/// value, and a deeper one is a protocol error. The recursive decoder and encoder, building Python objects,
/// take a body at the bound in a thread with a 256 KiB stack (Linux gives threads 8 MiB).
pub const MAX_DEPTH: usize = 1024;

/// Why a body is not a value of ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The body ends inside a value.
    Incomplete,
    /// 0xc1, the one byte msgpack never uses.
    Reserved,
    /// An extension type (fixext, ext 8/16/32): none is part of the protocol.
    Extension,
    /// A str, bin, array or map longer than the frame limit allows.
    TooLong { what: &'static str, len: u64, limit: usize },
    /// A map key other than str or bytes.
    KeyType,
    /// Containers deeper than MAX_DEPTH.
    TooDeep,
    /// Bytes after the value.
    ExtraData { left: usize },
    /// A str that is not UTF-8.
    Utf8,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Incomplete => write!(f, "the body ends inside a value"),
            Error::Reserved => write!(f, "reserved byte 0xc1"),
            Error::Extension => write!(f, "extension types are not part of the protocol"),
            Error::TooLong { what, len, limit } => write!(f, "{what} of length {len} exceeds the limit of {limit}"),
            Error::KeyType => write!(f, "a map key must be str or bytes"),
            Error::TooDeep => write!(f, "containers nested deeper than {MAX_DEPTH}"),
            Error::ExtraData { left } => write!(f, "{left} bytes after the message"),
            Error::Utf8 => write!(f, "a str that is not UTF-8"),
        }
    }
}

/// One msgpack item as it starts: a scalar whole, a container by its length (its items follow).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Token<'a> {
    Nil,
    Bool(bool),
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
}

impl Token<'_> {
    /// The token's value as a non-negative integer, if it is one (either integer family may carry it).
    #[inline]
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Token::Uint(v) => Some(v),
            Token::Int(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
}

/// A cursor over one body. `limit` bounds every length a header may declare.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    limit: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], limit: usize) -> Self {
        Reader { buf, pos: 0, limit }
    }

    /// Bytes not yet read.
    #[inline]
    pub fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// `Ok` if the whole body has been read.
    #[inline]
    pub fn finish(&self) -> Result<(), Error> {
        match self.left() {
            0 => Ok(()),
            left => Err(Error::ExtraData { left }),
        }
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if n > self.left() {
            return Err(Error::Incomplete);
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        Ok(self.take(N)?.try_into().expect("take returns N bytes"))
    }

    #[inline]
    fn be(&mut self, n: usize) -> Result<u64, Error> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, &b| acc << 8 | b as u64))
    }

    /// A str or bin of `len` bytes.
    #[inline]
    fn bytes(&mut self, what: &'static str, len: u64) -> Result<&'a [u8], Error> {
        if len > self.limit as u64 {
            return Err(Error::TooLong { what, len, limit: self.limit });
        }
        self.take(len as usize)
    }

    /// A container of `len` items, each at least `min` bytes: a length the rest of the body cannot hold is
    /// incomplete at once, so nothing is allocated for what a header merely claims.
    #[inline]
    fn container(&mut self, what: &'static str, len: u64, min: u64) -> Result<usize, Error> {
        if len > self.limit as u64 {
            return Err(Error::TooLong { what, len, limit: self.limit });
        }
        if len * min > self.left() as u64 {
            return Err(Error::Incomplete);
        }
        Ok(len as usize)
    }

    /// The next token.
    #[inline(always)]
    pub fn next(&mut self) -> Result<Token<'a>, Error> {
        let b = self.take(1)?[0];
        Ok(match b {
            0x00..=0x7f => Token::Uint(b as u64),
            0x80..=0x8f => Token::Map(self.container("map", (b & 0x0f) as u64, 2)?),
            0x90..=0x9f => Token::Array(self.container("array", (b & 0x0f) as u64, 1)?),
            0xa0..=0xbf => Token::Str(self.bytes("str", (b & 0x1f) as u64)?),
            0xc0 => Token::Nil,
            0xc1 => return Err(Error::Reserved),
            0xc2 => Token::Bool(false),
            0xc3 => Token::Bool(true),
            0xc4 | 0xc5 | 0xc6 => {
                let n = self.be(1 << (b - 0xc4))?;
                Token::Bin(self.bytes("bin", n)?)
            }
            0xc7..=0xc9 | 0xd4..=0xd8 => return Err(Error::Extension),
            0xca => Token::Float(f32::from_be_bytes(self.array()?) as f64),
            0xcb => Token::Float(f64::from_be_bytes(self.array()?)),
            0xcc..=0xcf => Token::Uint(self.be(1 << (b - 0xcc))?),
            0xd0 => Token::Int(i8::from_be_bytes(self.array()?) as i64),
            0xd1 => Token::Int(i16::from_be_bytes(self.array()?) as i64),
            0xd2 => Token::Int(i32::from_be_bytes(self.array()?) as i64),
            0xd3 => Token::Int(i64::from_be_bytes(self.array()?)),
            0xd9..=0xdb => {
                let n = self.be(1 << (b - 0xd9))?;
                Token::Str(self.bytes("str", n)?)
            }
            0xdc | 0xdd => {
                let n = self.be(2 << (b - 0xdc))?;
                Token::Array(self.container("array", n, 1)?)
            }
            0xde | 0xdf => {
                let n = self.be(2 << (b - 0xde))?;
                Token::Map(self.container("map", n, 2)?)
            }
            0xe0..=0xff => Token::Int(b as i8 as i64),
        })
    }
}

/// What a decoded body becomes. `scalar` never sees an Array or Map token; `key` says the scalar is a map key
/// (always a Str or Bin token), which a builder may intern.
pub trait Builder {
    type Value;
    type Error: From<Error>;
    fn scalar(&mut self, token: Token<'_>, key: bool) -> Result<Self::Value, Self::Error>;
    fn list(&mut self, len: usize) -> Result<Self::Value, Self::Error>;
    fn list_set(&mut self, list: &mut Self::Value, index: usize, item: Self::Value) -> Result<(), Self::Error>;
    fn map(&mut self, len: usize) -> Result<Self::Value, Self::Error>;
    fn map_set(&mut self, map: &mut Self::Value, key: Self::Value, item: Self::Value) -> Result<(), Self::Error>;
}

/// The next value, inside `depth` containers.
#[inline]
pub fn value<B: Builder>(r: &mut Reader<'_>, b: &mut B, depth: usize) -> Result<B::Value, B::Error> {
    let token = r.next()?;
    value_from(token, r, b, depth)
}

/// The value that `token`, just read, begins, inside `depth` containers.
pub fn value_from<B: Builder>(token: Token<'_>, r: &mut Reader<'_>, b: &mut B, depth: usize)
                              -> Result<B::Value, B::Error> {
    match token {
        Token::Array(len) => {
            if depth >= MAX_DEPTH {
                return Err(Error::TooDeep.into());
            }
            let mut list = b.list(len)?;
            for i in 0..len {
                let item = value(r, b, depth + 1)?;
                b.list_set(&mut list, i, item)?;
            }
            Ok(list)
        }
        Token::Map(len) => {
            if depth >= MAX_DEPTH {
                return Err(Error::TooDeep.into());
            }
            let mut map = b.map(len)?;
            for _ in 0..len {
                let key = match r.next()? {
                    t @ (Token::Str(_) | Token::Bin(_)) => b.scalar(t, true)?,
                    _ => return Err(Error::KeyType.into()),
                };
                let item = value(r, b, depth + 1)?;
                b.map_set(&mut map, key, item)?;
            }
            Ok(map)
        }
        t => b.scalar(t, false),
    }
}

/// The one value `body` holds, with nothing after it.
pub fn decode<B: Builder>(body: &[u8], limit: usize, b: &mut B) -> Result<B::Value, B::Error> {
    let mut r = Reader::new(body, limit);
    let v = value(&mut r, b, 0)?;
    r.finish()?;
    Ok(v)
}

// -- writing ------------------------------------------------------------------------------------------------

#[inline]
pub fn put_nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

#[inline]
pub fn put_bool(out: &mut Vec<u8>, v: bool) {
    out.push(if v { 0xc3 } else { 0xc2 });
}

/// A non-negative integer, in the smallest unsigned format.
#[inline]
pub fn put_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if v < 1 << 8 {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v < 1 << 16 {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v < 1 << 32 {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// Any i64: a non-negative one as `put_uint` writes it, a negative one in the smallest signed format.
#[inline]
pub fn put_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        put_uint(out, v as u64);
    } else if v >= -32 {
        out.push(v as i8 as u8);
    } else if v >= -(1 << 7) {
        out.extend_from_slice(&[0xd0, v as i8 as u8]);
    } else if v >= -(1 << 15) {
        out.push(0xd1);
        out.extend_from_slice(&(v as i16).to_be_bytes());
    } else if v >= -(1 << 31) {
        out.push(0xd2);
        out.extend_from_slice(&(v as i32).to_be_bytes());
    } else {
        out.push(0xd3);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

#[inline]
pub fn put_float(out: &mut Vec<u8>, v: f64) {
    out.push(0xcb);
    out.extend_from_slice(&v.to_be_bytes());
}

/// Lengths msgpack cannot declare (4 GiB and more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge(pub &'static str);

#[inline(always)]
fn put_len(out: &mut Vec<u8>, len: usize, small: Option<(u8, usize)>, codes: [u8; 3], what: &'static str)
           -> Result<(), TooLarge> {
    match small {
        Some((base, below)) if len < below => out.push(base | len as u8),
        _ if codes[0] != 0 && len < 1 << 8 => out.extend_from_slice(&[codes[0], len as u8]),
        _ if len < 1 << 16 => {
            out.push(codes[1]);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        _ if (len as u64) < 1 << 32 => {
            out.push(codes[2]);
            out.extend_from_slice(&(len as u32).to_be_bytes());
        }
        _ => return Err(TooLarge(what)),
    }
    Ok(())
}

#[inline]
pub fn put_str(out: &mut Vec<u8>, s: &[u8]) -> Result<(), TooLarge> {
    put_len(out, s.len(), Some((0xa0, 32)), [0xd9, 0xda, 0xdb], "str")?;
    out.extend_from_slice(s);
    Ok(())
}

#[inline]
pub fn put_bin(out: &mut Vec<u8>, s: &[u8]) -> Result<(), TooLarge> {
    put_len(out, s.len(), None, [0xc4, 0xc5, 0xc6], "bytes")?;
    out.extend_from_slice(s);
    Ok(())
}

#[inline]
pub fn put_array(out: &mut Vec<u8>, len: usize) -> Result<(), TooLarge> {
    put_len(out, len, Some((0x90, 16)), [0, 0xdc, 0xdd], "list")
}

#[inline]
pub fn put_map(out: &mut Vec<u8>, len: usize) -> Result<(), TooLarge> {
    put_len(out, len, Some((0x80, 16)), [0, 0xde, 0xdf], "dict")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone, PartialEq)]
    enum V {
        Nil,
        Bool(bool),
        Int(i128),
        Float(f64),
        Str(String),
        Bin(Vec<u8>),
        List(Vec<V>),
        Map(Vec<(V, V)>),
    }

    struct Plain;

    impl Builder for Plain {
        type Value = V;
        type Error = Error;
        fn scalar(&mut self, t: Token<'_>, _key: bool) -> Result<V, Error> {
            Ok(match t {
                Token::Nil => V::Nil,
                Token::Bool(b) => V::Bool(b),
                Token::Uint(v) => V::Int(v as i128),
                Token::Int(v) => V::Int(v as i128),
                Token::Float(v) => V::Float(v),
                Token::Str(s) => V::Str(std::str::from_utf8(s).map_err(|_| Error::Utf8)?.to_owned()),
                Token::Bin(s) => V::Bin(s.to_vec()),
                Token::Array(_) | Token::Map(_) => unreachable!("containers are built by value_from"),
            })
        }
        fn list(&mut self, len: usize) -> Result<V, Error> {
            Ok(V::List(Vec::with_capacity(len)))
        }
        fn list_set(&mut self, list: &mut V, _i: usize, item: V) -> Result<(), Error> {
            if let V::List(l) = list {
                l.push(item);
            }
            Ok(())
        }
        fn map(&mut self, _len: usize) -> Result<V, Error> {
            Ok(V::Map(Vec::new()))
        }
        fn map_set(&mut self, map: &mut V, k: V, v: V) -> Result<(), Error> {
            if let V::Map(m) = map {
                m.push((k, v));
            }
            Ok(())
        }
    }

    fn put(out: &mut Vec<u8>, v: &V) {
        match v {
            V::Nil => put_nil(out),
            V::Bool(b) => put_bool(out, *b),
            V::Int(i) if *i >= 0 => put_uint(out, *i as u64),
            V::Int(i) => put_int(out, *i as i64),
            V::Float(f) => put_float(out, *f),
            V::Str(s) => put_str(out, s.as_bytes()).unwrap(),
            V::Bin(b) => put_bin(out, b).unwrap(),
            V::List(l) => {
                put_array(out, l.len()).unwrap();
                l.iter().for_each(|x| put(out, x));
            }
            V::Map(m) => {
                put_map(out, m.len()).unwrap();
                for (k, x) in m {
                    put(out, k);
                    put(out, x);
                }
            }
        }
    }

    fn dec(body: &[u8]) -> Result<V, Error> {
        decode(body, 1 << 20, &mut Plain)
    }

    fn enc(v: &V) -> Vec<u8> {
        let mut out = Vec::new();
        put(&mut out, v);
        out
    }

    fn nested(depth: usize) -> Vec<u8> {
        let mut body = vec![0x91; depth - 1];
        body.push(0x90);
        body
    }

    /// Runs `f` with room for MAX_DEPTH levels of an unoptimised build (the test harness's threads have 2 MiB).
    fn deep_stack(f: impl FnOnce() + Send + 'static) {
        std::thread::Builder::new().stack_size(256 << 20).spawn(f).unwrap().join().unwrap();
    }

    #[test]
    fn depth_up_to_the_bound_decodes_and_one_more_is_refused() {
        deep_stack(depth_cases);
    }

    fn depth_cases() {
        assert!(dec(&nested(MAX_DEPTH)).is_ok());
        assert_eq!(dec(&nested(MAX_DEPTH + 1)), Err(Error::TooDeep));
        // Maps count as containers too.
        let mut body = vec![0x81, 0xa1, b'k'].repeat(MAX_DEPTH + 1);
        body.push(0xc0);
        assert_eq!(dec(&body), Err(Error::TooDeep));
        assert!(dec(&body[3..]).is_ok());
    }

    #[test]
    fn every_extension_format_is_refused() {
        for head in [0xd4u8, 0xd5, 0xd6, 0xd7, 0xd8, 0xc7, 0xc8, 0xc9] {
            let mut body = vec![head, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            assert_eq!(dec(&body), Err(Error::Extension), "{head:#x}");
            body.truncate(1);
            assert_eq!(dec(&body), Err(Error::Extension), "{head:#x} with nothing after it");
        }
        // An ext 8 of length 0 is an extension too (msgpack-python would hand back an ExtType).
        assert_eq!(dec(&[0xc7, 0x00, 0x05]), Err(Error::Extension));
    }

    #[test]
    fn reserved_byte_truncation_and_trailing_bytes_are_errors() {
        assert_eq!(dec(&[0xc1]), Err(Error::Reserved));
        assert_eq!(dec(&[]), Err(Error::Incomplete));
        assert_eq!(dec(&[0x92, 0x01]), Err(Error::Incomplete));
        assert_eq!(dec(&[0xcd, 0x01]), Err(Error::Incomplete));
        assert_eq!(dec(&[0xa3, b'a', b'b']), Err(Error::Incomplete));
        assert_eq!(dec(&[0x91, 0x01, 0x02]), Err(Error::ExtraData { left: 1 }));
    }

    #[test]
    fn map_keys_are_str_or_bytes() {
        assert_eq!(dec(&[0x81, 0x01, 0x02]), Err(Error::KeyType));
        assert_eq!(dec(&[0x81, 0xc0, 0x02]), Err(Error::KeyType));
        assert_eq!(dec(&[0x81, 0x90, 0x02]), Err(Error::KeyType));
        assert_eq!(dec(&[0x81, 0xa1, b'k', 0x02]), Ok(V::Map(vec![(V::Str("k".into()), V::Int(2))])));
        assert_eq!(dec(&[0x81, 0xc4, 0x01, b'k', 0x02]), Ok(V::Map(vec![(V::Bin(b"k".to_vec()), V::Int(2))])));
    }

    #[test]
    fn declared_lengths_beyond_the_limit_or_the_body_are_refused_before_anything_is_built() {
        let limit = 100;
        let r = |b: &[u8]| decode(b, limit, &mut Plain);
        assert!(matches!(r(&[0xd9, 101]), Err(Error::TooLong { what: "str", len: 101, .. })));
        assert!(matches!(r(&[0xc5, 0, 101]), Err(Error::TooLong { what: "bin", .. })));
        assert!(matches!(r(&[0xdc, 0, 101]), Err(Error::TooLong { what: "array", .. })));
        assert!(matches!(r(&[0xdf, 0xff, 0xff, 0xff, 0xff]), Err(Error::TooLong { what: "map", .. })));
        // Within the limit but more items than the bytes left could hold.
        assert_eq!(r(&[0xdc, 0, 50, 1, 2]), Err(Error::Incomplete));
        assert_eq!(r(&[0xde, 0, 2, 0xa1, b'k', 1]), Err(Error::Incomplete));
        assert!(r(&[0xd9, 100].iter().copied().chain([b'x'; 100]).collect::<Vec<_>>()).is_ok());
    }

    #[test]
    fn integers_cover_i64_and_u64_in_every_format() {
        let cases: [(&[u8], i128); 12] = [
            (&[0x7f], 127), (&[0xe0], -32), (&[0xcc, 0xff], 255), (&[0xcd, 0xff, 0xff], 65535),
            (&[0xce, 0xff, 0xff, 0xff, 0xff], u32::MAX as i128), (&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], u64::MAX as i128),
            (&[0xd0, 0x80], -128), (&[0xd1, 0x80, 0x00], -32768), (&[0xd2, 0x80, 0, 0, 0], i32::MIN as i128),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], i64::MIN as i128), (&[0xd0, 0x7f], 127), (&[0xd3, 0, 0, 0, 0, 0, 0, 0, 1], 1),
        ];
        for (body, want) in cases {
            assert_eq!(dec(body), Ok(V::Int(want)), "{body:x?}");
        }
    }

    #[test]
    fn floats_of_both_widths_and_invalid_utf8() {
        assert_eq!(dec(&[0xca, 0x3f, 0xc0, 0, 0]), Ok(V::Float(1.5)));
        assert_eq!(dec(&[0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]), Ok(V::Float(1.5)));
        assert_eq!(dec(&[0xa2, 0xc3, 0x28]), Err(Error::Utf8));
        assert_eq!(dec(&[0xa3, 0xed, 0xa0, 0x80]), Err(Error::Utf8)); // a surrogate, as Python refuses too
    }

    #[test]
    fn writers_pick_msgpack_pythons_formats_at_every_boundary() {
        let w = |v: V| enc(&v);
        assert_eq!(w(V::Int(127)), [0x7f]);
        assert_eq!(w(V::Int(128)), [0xcc, 0x80]);
        assert_eq!(w(V::Int(256)), [0xcd, 0x01, 0x00]);
        assert_eq!(w(V::Int(65536)), [0xce, 0, 1, 0, 0]);
        assert_eq!(w(V::Int(1 << 32)), [0xcf, 0, 0, 0, 1, 0, 0, 0, 0]);
        assert_eq!(w(V::Int(-1)), [0xff]);
        assert_eq!(w(V::Int(-33)), [0xd0, 0xdf]);
        assert_eq!(w(V::Int(-129)), [0xd1, 0xff, 0x7f]);
        assert_eq!(w(V::Int(-32769)), [0xd2, 0xff, 0xff, 0x7f, 0xff]);
        assert_eq!(w(V::Int(-(1 << 31) - 1))[0], 0xd3);
        assert_eq!(w(V::Str("x".repeat(31)))[0], 0xbf);
        assert_eq!(w(V::Str("x".repeat(32)))[..2], [0xd9, 32]);
        assert_eq!(w(V::Str("x".repeat(256)))[..3], [0xda, 1, 0]);
        assert_eq!(w(V::Bin(vec![]))[..2], [0xc4, 0]);
        assert_eq!(w(V::Bin(vec![0; 256]))[..3], [0xc5, 1, 0]);
        assert_eq!(w(V::List(vec![V::Nil; 15]))[0], 0x9f);
        assert_eq!(w(V::List(vec![V::Nil; 16]))[..3], [0xdc, 0, 16]);
        let map = |n: usize| V::Map((0..n).map(|i| (V::Str(i.to_string()), V::Nil)).collect());
        assert_eq!(w(map(15))[0], 0x8f);
        assert_eq!(w(map(16))[..3], [0xde, 0, 16]);
        assert_eq!(w(V::Float(0.5)), [0xcb, 0x3f, 0xe0, 0, 0, 0, 0, 0, 0]);
    }

    fn scalar() -> impl Strategy<Value = V> {
        prop_oneof![
            Just(V::Nil),
            any::<bool>().prop_map(V::Bool),
            any::<u64>().prop_map(|v| V::Int(v as i128)),
            any::<i64>().prop_map(|v| V::Int(v as i128)),
            any::<f64>().prop_filter("NaN is not equal to itself", |f| !f.is_nan()).prop_map(V::Float),
            ".{0,40}".prop_map(V::Str),
            proptest::collection::vec(any::<u8>(), 0..300).prop_map(V::Bin),
        ]
    }

    fn tree() -> impl Strategy<Value = V> {
        scalar().prop_recursive(6, 64, 20, |inner| {
            let key = prop_oneof![".{0,8}".prop_map(V::Str), proptest::collection::vec(any::<u8>(), 0..8).prop_map(V::Bin)];
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..20).prop_map(V::List),
                proptest::collection::vec((key, inner), 0..20).prop_map(V::Map),
            ]
        })
    }

    fn has_nan(v: &V) -> bool {
        match v {
            V::Float(f) => f.is_nan(),
            V::List(l) => l.iter().any(has_nan),
            V::Map(m) => m.iter().any(|(k, x)| has_nan(k) || has_nan(x)),
            _ => false,
        }
    }

    proptest! {
        #[test]
        fn any_value_round_trips(v in tree()) {
            prop_assert_eq!(dec(&enc(&v)), Ok(v));
        }

        #[test]
        fn arbitrary_bytes_never_panic_and_a_decoded_prefix_re_encodes_to_itself(
            body in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut r = Reader::new(&body, 1 << 20);
            if let Ok(v) = value(&mut r, &mut Plain, 0) {
                prop_assume!(!has_nan(&v));
                let used = body.len() - r.left();
                // The same value, though not always the same bytes: a writer picks the smallest format.
                prop_assert_eq!(dec(&enc(&v)), Ok(v.clone()));
                prop_assert_eq!(dec(&body[..used]), Ok(v));
            }
        }
    }
}
