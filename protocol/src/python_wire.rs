//! The Python face of the wire codec, `mpsd_protocol._wire.Codec`: a frame body decoded straight into the message
//! objects `mpsd_protocol._messages.from_wire` makes (its dataclasses, filled slot by slot, with the checks
//! their `__post_init__` makes done here), and a message encoded into its whole frame, header included.
//! msgpack-python built ~25 Python objects per launch and a fresh str for every map key; here map keys, op
//! names and short str values come from a small cache of str objects keyed by their bytes, so a launch's keys
//! cost no allocation.
//!
//! What is not the common shape (a kind or id of another type, a reply whose error is neither nil nor a map,
//! fds that fail the dataclass's check) is decoded whole and handed to `from_wire`, so that every malformed
//! message is judged, and its error worded, by the one Python function that does so today.

use rustc_hash::FxHashMap;
use crate::wire::{self, Builder, Error, Reader, Token, MAX_DEPTH};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};
use std::mem::MaybeUninit;
use std::os::raw::c_char;
use std::ptr::{addr_of_mut, null};
use std::sync::{Mutex, MutexGuard, TryLockError};

/// The largest request or reply id (mpsd_protocol._messages.MAX_ID).
const MAX_ID: u64 = u32::MAX as u64;
/// Kinds of message, the first item of each (mpsd_protocol._messages).
const REQUEST: u64 = 0;
const REPLY: u64 = 1;
const NOTIFICATION: u64 = 2;

// -- str cache ------------------------------------------------------------------------------------------------

const SLOTS: usize = 512;
const SLOT_BITS: u32 = SLOTS.trailing_zeros();
/// Longer strs are built every time: names and keys are shorter.
const CACHED_LEN: usize = 32;

struct Slot {
    len: usize,
    bytes: [u8; CACHED_LEN],
    obj: Option<Py<PyAny>>,
}

impl Slot {
    const EMPTY: Slot = Slot { len: 0, bytes: [0; CACHED_LEN], obj: None };
}

/// Direct-mapped: a str takes its slot from whatever was there, so a peer that sends many distinct strs
/// slows the cache down but cannot fill it for good, and it never holds more than SLOTS strs.
struct Strs {
    slots: [Slot; SLOTS],
}

static STRS: Mutex<Strs> = Mutex::new(Strs { slots: [Slot::EMPTY; SLOTS] });
/// The buffer frames are encoded into, kept between calls so that a frame costs one allocation (its bytes).
static OUT: Mutex<Vec<u8>> = Mutex::new(Vec::new());

/// A lock taken without waiting: every call holds the GIL, so the lock is only ever busy when a call is
/// re-entered on the same thread (a finalizer run by the collector inside it) or the GIL was let go inside
/// one (a thread switch in such a finalizer); that call then does without.
fn try_take<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

#[inline]
fn slot_of(s: &[u8]) -> usize {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = s.len() as u64;
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        h = (h.rotate_left(5) ^ u64::from_le_bytes(c.try_into().expect("8 bytes"))).wrapping_mul(K);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        h = (h.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
    }
    (h >> (64 - SLOT_BITS)) as usize
}

/// A new str from UTF-8 bytes (Python's strict decoder: the error is its UnicodeDecodeError).
fn new_str<'py>(py: Python<'py>, s: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    unsafe {
        let p = ffi::PyUnicode_DecodeUTF8(s.as_ptr() as *const c_char, s.len() as ffi::Py_ssize_t, null());
        Bound::from_owned_ptr_or_err(py, p)
    }
}

impl Strs {
    /// The str of `s`, from the cache if it is there; a new one is interned when `intern` (map keys and op
    /// names: Python code looks them up by literals, which are interned, and equal pointers compare at once).
    fn get<'py>(&mut self, py: Python<'py>, s: &[u8], intern: bool) -> PyResult<Bound<'py, PyAny>> {
        let slot = &mut self.slots[slot_of(s)];
        if let Some(obj) = &slot.obj {
            if slot.len == s.len() && slot.bytes[..s.len()] == *s {
                return Ok(obj.bind(py).clone());
            }
        }
        let mut obj = new_str(py, s)?;
        if intern {
            unsafe {
                let mut p = obj.into_ptr();
                ffi::PyUnicode_InternInPlace(&mut p);
                obj = Bound::from_owned_ptr(py, p);
            }
        }
        slot.len = s.len();
        slot.bytes[..s.len()].copy_from_slice(s);
        slot.obj = Some(obj.clone().unbind());
        Ok(obj)
    }
}

// -- decoding -------------------------------------------------------------------------------------------------

/// Why a body could not be decoded: the wire's rules, or Python's (a str's UTF-8, memory). Boxed, so that
/// every builder call returns its result in registers: failure is the rare path.
struct Fail(Box<Why>);

enum Why {
    Wire(Error),
    Py(PyErr),
}

impl From<Error> for Fail {
    #[cold]
    fn from(e: Error) -> Self {
        Fail(Box::new(Why::Wire(e)))
    }
}

impl From<PyErr> for Fail {
    #[cold]
    fn from(e: PyErr) -> Self {
        Fail(Box::new(Why::Py(e)))
    }
}

/// Python objects, as msgpack-python's `unpackb(raw=False, use_list=True)` gives them.
struct Objects<'a, 'py> {
    py: Python<'py>,
    strs: Option<&'a mut Strs>,
}

impl<'py> Objects<'_, 'py> {
    fn str(&mut self, s: &[u8], intern: bool) -> PyResult<Bound<'py, PyAny>> {
        match &mut self.strs {
            Some(strs) if s.len() <= CACHED_LEN => strs.get(self.py, s, intern),
            _ => new_str(self.py, s),
        }
    }
}

impl<'py> Builder for Objects<'_, 'py> {
    type Value = Bound<'py, PyAny>;
    type Error = Fail;

    fn scalar(&mut self, t: Token<'_>, key: bool) -> Result<Self::Value, Fail> {
        let py = self.py;
        unsafe {
            let p = match t {
                Token::Nil => return Ok(py.None().into_bound(py)),
                Token::Bool(b) => {
                    let p = if b { ffi::Py_True() } else { ffi::Py_False() };
                    ffi::Py_INCREF(p);
                    p
                }
                Token::Uint(v) => ffi::PyLong_FromUnsignedLongLong(v),
                Token::Int(v) => ffi::PyLong_FromLongLong(v),
                Token::Float(v) => ffi::PyFloat_FromDouble(v),
                Token::Str(s) => return Ok(self.str(s, key)?),
                Token::Bin(s) => ffi::PyBytes_FromStringAndSize(s.as_ptr() as *const c_char, s.len() as ffi::Py_ssize_t),
                Token::Array(_) | Token::Map(_) => unreachable!("wire::value_from builds containers"),
            };
            Ok(Bound::from_owned_ptr_or_err(py, p)?)
        }
    }

    fn list(&mut self, len: usize) -> Result<Self::Value, Fail> {
        unsafe { Ok(Bound::from_owned_ptr_or_err(self.py, ffi::PyList_New(len as ffi::Py_ssize_t))?) }
    }

    fn list_set(&mut self, list: &mut Self::Value, i: usize, item: Self::Value) -> Result<(), Fail> {
        // PyList_SetItem takes the item's reference, even when it fails (it cannot here: i < len).
        if unsafe { ffi::PyList_SetItem(list.as_ptr(), i as ffi::Py_ssize_t, item.into_ptr()) } < 0 {
            return Err(PyErr::fetch(self.py).into());
        }
        Ok(())
    }

    fn map(&mut self, _len: usize) -> Result<Self::Value, Fail> {
        unsafe { Ok(Bound::from_owned_ptr_or_err(self.py, ffi::PyDict_New())?) }
    }

    fn map_set(&mut self, map: &mut Self::Value, key: Self::Value, item: Self::Value) -> Result<(), Fail> {
        if unsafe { ffi::PyDict_SetItem(map.as_ptr(), key.as_ptr(), item.as_ptr()) } < 0 {
            return Err(PyErr::fetch(self.py).into());
        }
        Ok(())
    }
}

/// A bytes-like object's bytes, held (a bytearray cannot be resized while they are).
struct View(ffi::Py_buffer);

impl View {
    fn of(obj: &Bound<'_, PyAny>) -> PyResult<View> {
        let mut view = MaybeUninit::<ffi::Py_buffer>::zeroed();
        unsafe {
            if ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_SIMPLE) < 0 {
                return Err(PyErr::fetch(obj.py()));
            }
            Ok(View(view.assume_init()))
        }
    }

    fn bytes(&self) -> &[u8] {
        if self.0.len == 0 {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(self.0.buf as *const u8, self.0.len as usize) }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        unsafe { ffi::PyBuffer_Release(&mut self.0) }
    }
}

/// One message class: how to make an instance without running its `__init__`, and the member descriptors
/// of its slots, in the order of its fields.
struct Class {
    ty: Py<PyType>,
    alloc: ffi::allocfunc,
    fields: Vec<(Py<PyAny>, ffi::descrsetfunc, ffi::descrgetfunc)>,
}

impl Class {
    fn new(ty: &Bound<'_, PyType>, names: &[&str]) -> PyResult<Class> {
        unsafe {
            let alloc = ffi::PyType_GetSlot(ty.as_ptr() as *mut ffi::PyTypeObject, ffi::Py_tp_alloc);
            if alloc.is_null() {
                return Err(PyTypeError::new_err("a message class needs tp_alloc"));
            }
            let mut fields = Vec::new();
            for name in names {
                let descr = ty.getattr(*name)?;
                let dty = ffi::Py_TYPE(descr.as_ptr());
                let set = ffi::PyType_GetSlot(dty, ffi::Py_tp_descr_set);
                let get = ffi::PyType_GetSlot(dty, ffi::Py_tp_descr_get);
                if descr.get_type().name()? != "member_descriptor" || set.is_null() || get.is_null() {
                    return Err(PyTypeError::new_err(format!("{name} of a message class must be a slot")));
                }
                fields.push((descr.unbind(), std::mem::transmute::<*mut std::ffi::c_void, ffi::descrsetfunc>(set),
                             std::mem::transmute::<*mut std::ffi::c_void, ffi::descrgetfunc>(get)));
            }
            Ok(Class { ty: ty.clone().unbind(), alloc: std::mem::transmute::<*mut std::ffi::c_void, ffi::allocfunc>(alloc), fields })
        }
    }

    /// An instance with these field values, as the dataclass's `__init__` would leave it.
    fn make<'py>(&self, py: Python<'py>, values: &[&Bound<'py, PyAny>]) -> PyResult<Bound<'py, PyAny>> {
        unsafe {
            let obj = Bound::from_owned_ptr_or_err(py, (self.alloc)(self.ty.as_ptr() as *mut ffi::PyTypeObject, 0))?;
            for ((descr, set, _), v) in self.fields.iter().zip(values) {
                if set(descr.as_ptr(), obj.as_ptr(), v.as_ptr()) < 0 {
                    return Err(PyErr::fetch(py));
                }
            }
            Ok(obj)
        }
    }

    /// Field `i` of `obj`, an instance.
    fn get<'py>(&self, obj: &Bound<'py, PyAny>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let (descr, _, get) = &self.fields[i];
        unsafe { Bound::from_owned_ptr_or_err(obj.py(), get(descr.as_ptr(), obj.as_ptr(), self.ty.as_ptr())) }
    }
}

/// The codec `mpsd_protocol._connection` makes once, from its message classes and error types.
#[pyclass(frozen, module = "mpsd_protocol._wire")]
pub struct Codec {
    request: Class,
    reply: Class,
    notification: Class,
    from_wire: PyObject,
    remote_error: PyObject,
    local_error: PyObject,
    max_fds: usize,
}

impl Codec {
    fn remote(&self, py: Python<'_>, why: Fail) -> PyErr {
        let detail = match *why.0 {
            Why::Wire(e) => e.to_string(),
            Why::Py(e) => {
                let name = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
                format!("{name}: {}", e.value(py))
            }
        };
        // As long as the words msgpack's errors gave: a peer's bytes may end up in the text.
        let text: String = format!("undecodable frame body: {detail}").chars().take(200).collect();
        self.error(py, &self.remote_error, text)
    }

    fn error(&self, py: Python<'_>, class: &PyObject, text: String) -> PyErr {
        match class.call1(py, (text,)) {
            Ok(exc) => PyErr::from_value(exc.into_bound(py)),
            Err(e) => e,
        }
    }

    /// `f`, with a panic in it (a bug of ours, whatever the peer sent) turned into `class`'s error: PyO3 turns
    /// a panic into its PanicException, a BaseException, which no handler of a message's errors expects, so a
    /// bug met by one peer's bytes would end the whole daemon rather than that peer's connection.
    fn guarded<T>(&self, py: Python<'_>, class: &PyObject, what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
            Err(self.error(py, class, format!("{what}: the codec failed (a fault of mpsd's, not of the message)")))
        })
    }

    /// `encode`'s work, unguarded.
    fn encode_frame<'py>(&self, py: Python<'py>, message: &Bound<'py, PyAny>, limit: usize) -> PyResult<Bound<'py, PyBytes>> {
        let mut kept = try_take(&OUT);
        let mut own = Vec::new();
        let out: &mut Vec<u8> = match kept.as_deref_mut() {
            Some(v) => v,
            None => &mut own,
        };
        out.clear();
        out.extend_from_slice(&[0; 8]);
        let ty = message.get_type();
        let fields = |class: &Class, n: usize| -> PyResult<Vec<Bound<'py, PyAny>>> {
            (0..n).map(|i| class.get(message, i)).collect()
        };
        let (done, fds) = unsafe {
            // A request and a reply are both [kind, three fields]; a notification is [kind, two fields].
            let four = if ty.is(&self.request.ty) {
                Some((&self.request, REQUEST))
            } else if ty.is(&self.reply.ty) {
                Some((&self.reply, REPLY))
            } else {
                None
            };
            if let Some((class, kind)) = four {
                let f = fields(class, 4)?;
                out.extend_from_slice(&[0x94, kind as u8]);
                let done = put(py, out, f[0].as_ptr(), 1)
                    .and_then(|_| put(py, out, f[1].as_ptr(), 1))
                    .and_then(|_| put(py, out, f[2].as_ptr(), 1));
                (done, f[3].clone())
            } else if ty.is(&self.notification.ty) {
                let f = fields(&self.notification, 3)?;
                out.extend_from_slice(&[0x93, NOTIFICATION as u8]);
                let done = put(py, out, f[0].as_ptr(), 1).and_then(|_| put(py, out, f[1].as_ptr(), 1));
                (done, f[2].clone())
            } else {
                // A subclass, or anything else with the message interface.
                let wire = message.call_method0(intern!(py, "to_wire"))?;
                let done = put(py, out, wire.as_ptr(), 0);
                (done, message.getattr(intern!(py, "fds"))?)
            }
        };
        if let Err(why) = done {
            let exc = match why {
                Refusal::Type(s) | Refusal::Value(s) => s,
                Refusal::Overflow => "Integer value out of range".to_owned(),
                Refusal::Py(e) => {
                    let refused = e.is_instance_of::<PyTypeError>(py) || e.is_instance_of::<PyValueError>(py)
                        || e.is_instance_of::<PyOverflowError>(py);
                    if !refused {
                        return Err(e);
                    }
                    e.value(py).to_string()
                }
            };
            let text = format!("cannot encode {}: {exc}", ty.name()?);
            return Err(self.error(py, &self.local_error, text));
        }
        let body = out.len() - 8;
        if body > limit || body > u32::MAX as usize {
            return Err(self.error(py, &self.local_error, format!("frame of {body} bytes exceeds the limit of {limit}")));
        }
        let nfds = fds.len()?;
        out[..4].copy_from_slice(&(body as u32).to_le_bytes());
        out[4..8].copy_from_slice(&(nfds as u32).to_le_bytes());
        let frame = PyBytes::new(py, out);
        if out.capacity() > 1 << 20 {
            // A large frame now and then should not keep its buffer.
            out.clear();
            out.shrink_to(1 << 16);
        }
        Ok(frame)
    }

    /// The message `body` holds, with the frame's fds.
    fn decode_body<'py>(&self, py: Python<'py>, body: &[u8], fds: &Bound<'py, PyAny>, limit: usize)
                        -> PyResult<Bound<'py, PyAny>> {
        self.guarded(py, &self.remote_error, "undecodable frame body", || self.decode_unguarded(py, body, fds, limit))
    }

    fn decode_unguarded<'py>(&self, py: Python<'py>, body: &[u8], fds: &Bound<'py, PyAny>, limit: usize)
                             -> PyResult<Bound<'py, PyAny>> {
        let mut strs = try_take(&STRS);
        let mut b = Objects { py, strs: strs.as_deref_mut() };
        let mut r = Reader::new(body, limit);
        match self.common(&mut b, &mut r, fds) {
            Ok(Some(message)) => return Ok(message),
            Ok(None) => {}
            Err(why) => return Err(self.remote(py, why)),
        }
        let obj = wire::decode(body, limit, &mut b).map_err(|why| self.remote(py, why))?;
        drop(strs);
        self.from_wire.call1(py, (obj, fds)).map(|m| m.into_bound(py))
    }

    /// `fds` as the dataclasses accept them: a tuple of at most max_fds non-negative ints.
    fn fds_ok(&self, fds: &Bound<'_, PyAny>) -> bool {
        unsafe {
            let p = fds.as_ptr();
            if ffi::Py_TYPE(p) != addr_of_mut!(ffi::PyTuple_Type) {
                return false;
            }
            let n = ffi::PyTuple_Size(p);
            if n as usize > self.max_fds {
                return false;
            }
            (0..n).all(|i| {
                let fd = ffi::PyTuple_GetItem(p, i);
                // (An int past i64 leaves no error set this way: from_wire judges it.)
                let mut overflow = 0;
                ffi::Py_TYPE(fd) == addr_of_mut!(ffi::PyLong_Type)
                    && ffi::PyLong_AsLongLongAndOverflow(fd, &mut overflow) >= 0 && overflow == 0
            })
        }
    }

    /// The message of the common shape that `r` begins, or None where the body is of another shape (read
    /// again whole by the caller, for `from_wire` to judge).
    fn common<'py>(&self, b: &mut Objects<'_, 'py>, r: &mut Reader<'_>, fds: &Bound<'py, PyAny>)
                   -> Result<Option<Bound<'py, PyAny>>, Fail> {
        let py = b.py;
        if !self.fds_ok(fds) {
            return Ok(None);
        }
        let Token::Array(len) = r.next()? else { return Ok(None) };
        let Some(kind) = r.next()?.as_u64() else { return Ok(None) };
        let id = |r: &mut Reader<'_>| -> Result<Option<Bound<'py, PyAny>>, Fail> {
            match r.next()?.as_u64() {
                Some(id) if id <= MAX_ID => Ok(Some(unsafe {
                    Bound::from_owned_ptr_or_err(py, ffi::PyLong_FromUnsignedLongLong(id))?
                })),
                _ => Ok(None),
            }
        };
        let message = match (kind, len) {
            (REQUEST, 4) => {
                let Some(id) = id(r)? else { return Ok(None) };
                let Token::Str(op) = r.next()? else { return Ok(None) };
                let op = b.str(op, true)?;
                let t @ Token::Map(_) = r.next()? else { return Ok(None) };
                let args = wire::value_from(t, r, b, 1)?;
                r.finish()?;
                self.request.make(py, &[&id, &op, &args, fds])?
            }
            (REPLY, 4) => {
                let Some(id) = id(r)? else { return Ok(None) };
                let error = match r.next()? {
                    Token::Nil => py.None().into_bound(py),
                    t @ Token::Map(_) => wire::value_from(t, r, b, 1)?,
                    _ => return Ok(None),
                };
                let result = wire::value(r, b, 1)?;
                r.finish()?;
                self.reply.make(py, &[&id, &error, &result, fds])?
            }
            (NOTIFICATION, 3) => {
                let Token::Str(op) = r.next()? else { return Ok(None) };
                let op = b.str(op, true)?;
                let t @ Token::Map(_) = r.next()? else { return Ok(None) };
                let args = wire::value_from(t, r, b, 1)?;
                r.finish()?;
                self.notification.make(py, &[&op, &args, fds])?
            }
            _ => return Ok(None),
        };
        Ok(Some(message))
    }
}

// -- encoding -------------------------------------------------------------------------------------------------

/// Why a value cannot be encoded, as msgpack-python's Packer said it (the exception type and its words).
enum Refusal {
    Type(String),
    Value(String),
    Overflow,
    Py(PyErr),
}

impl From<wire::TooLarge> for Refusal {
    fn from(e: wire::TooLarge) -> Self {
        Refusal::Value(format!("{} is too large", e.0))
    }
}

unsafe fn is(o: *mut ffi::PyObject, ty: *mut ffi::PyTypeObject) -> bool {
    ffi::Py_TYPE(o) == ty
}

/// Append `o` (borrowed), inside `depth` containers. No Python code runs in here (every object is read
/// through the C API, none is made), so the containers walked by borrowed references cannot change under it.
unsafe fn put(py: Python<'_>, out: &mut Vec<u8>, o: *mut ffi::PyObject, depth: usize) -> Result<(), Refusal> {
    if is(o, addr_of_mut!(ffi::PyUnicode_Type)) {
        return put_str(py, out, o);
    }
    if is(o, addr_of_mut!(ffi::PyLong_Type)) {
        return put_long(py, out, o);
    }
    if o == ffi::Py_None() {
        wire::put_nil(out);
        return Ok(());
    }
    if is(o, addr_of_mut!(ffi::PyBool_Type)) {
        wire::put_bool(out, o == ffi::Py_True());
        return Ok(());
    }
    if is(o, addr_of_mut!(ffi::PyDict_Type)) {
        return put_dict(py, out, o, depth);
    }
    if is(o, addr_of_mut!(ffi::PyList_Type)) {
        return put_seq(py, out, o, depth, ffi::PyList_Size, ffi::PyList_GetItem);
    }
    if is(o, addr_of_mut!(ffi::PyFloat_Type)) {
        wire::put_float(out, ffi::PyFloat_AsDouble(o));
        return Ok(());
    }
    if is(o, addr_of_mut!(ffi::PyTuple_Type)) {
        return put_seq(py, out, o, depth, ffi::PyTuple_Size, ffi::PyTuple_GetItem);
    }
    if is(o, addr_of_mut!(ffi::PyBytes_Type)) {
        return put_bytes(py, out, o);
    }
    // Subclasses (an IntEnum, a StrEnum), in the order msgpack-python tries them.
    if ffi::PyLong_Check(o) != 0 {
        return put_long(py, out, o);
    }
    if ffi::PyFloat_Check(o) != 0 {
        let v = ffi::PyFloat_AsDouble(o);
        if v == -1.0 {
            if let Some(e) = PyErr::take(py) {
                return Err(Refusal::Py(e));
            }
        }
        wire::put_float(out, v);
        return Ok(());
    }
    if ffi::PyBytes_Check(o) != 0 {
        return put_bytes(py, out, o);
    }
    if ffi::PyByteArray_Check(o) != 0 {
        let p = ffi::PyByteArray_AsString(o) as *const u8;
        let n = ffi::PyByteArray_Size(o) as usize;
        let s = if n == 0 { &[][..] } else { std::slice::from_raw_parts(p, n) };
        return Ok(wire::put_bin(out, s)?);
    }
    if ffi::PyUnicode_Check(o) != 0 {
        return put_str(py, out, o);
    }
    if ffi::PyDict_Check(o) != 0 {
        return put_dict(py, out, o, depth);
    }
    if ffi::PyList_Check(o) != 0 {
        return put_seq(py, out, o, depth, ffi::PyList_Size, ffi::PyList_GetItem);
    }
    if ffi::PyTuple_Check(o) != 0 {
        return put_seq(py, out, o, depth, ffi::PyTuple_Size, ffi::PyTuple_GetItem);
    }
    if ffi::PyMemoryView_Check(o) != 0 {
        let view = View::of(&Bound::from_borrowed_ptr(py, o)).map_err(Refusal::Py)?;
        return Ok(wire::put_bin(out, view.bytes())?);
    }
    let name = Bound::from_borrowed_ptr(py, o).get_type().name().map(|n| n.to_string()).unwrap_or_default();
    Err(Refusal::Type(format!("can not serialize '{name}' object")))
}

#[inline]
unsafe fn put_str(py: Python<'_>, out: &mut Vec<u8>, o: *mut ffi::PyObject) -> Result<(), Refusal> {
    let mut n: ffi::Py_ssize_t = 0;
    let p = ffi::PyUnicode_AsUTF8AndSize(o, &mut n);
    if p.is_null() {
        return Err(Refusal::Py(PyErr::fetch(py)));
    }
    Ok(wire::put_str(out, std::slice::from_raw_parts(p as *const u8, n as usize))?)
}

unsafe fn put_bytes(py: Python<'_>, out: &mut Vec<u8>, o: *mut ffi::PyObject) -> Result<(), Refusal> {
    let mut p: *mut c_char = std::ptr::null_mut();
    let mut n: ffi::Py_ssize_t = 0;
    if ffi::PyBytes_AsStringAndSize(o, &mut p, &mut n) < 0 {
        return Err(Refusal::Py(PyErr::fetch(py)));
    }
    let s = if n == 0 { &[][..] } else { std::slice::from_raw_parts(p as *const u8, n as usize) };
    Ok(wire::put_bin(out, s)?)
}

#[inline]
unsafe fn put_long(py: Python<'_>, out: &mut Vec<u8>, o: *mut ffi::PyObject) -> Result<(), Refusal> {
    let mut overflow = 0;
    let v = ffi::PyLong_AsLongLongAndOverflow(o, &mut overflow);
    if overflow == 0 {
        if v == -1 {
            if let Some(e) = PyErr::take(py) {
                return Err(Refusal::Py(e));
            }
        }
        wire::put_int(out, v);
        return Ok(());
    }
    if overflow > 0 {
        let u = ffi::PyLong_AsUnsignedLongLong(o);
        if u != u64::MAX || PyErr::take(py).is_none() {
            wire::put_uint(out, u);
            return Ok(());
        }
    }
    Err(Refusal::Overflow)
}

fn deeper(depth: usize) -> Result<(), Refusal> {
    if depth >= MAX_DEPTH {
        return Err(Refusal::Value(format!("containers nested deeper than {MAX_DEPTH}")));
    }
    Ok(())
}

unsafe fn put_dict(py: Python<'_>, out: &mut Vec<u8>, o: *mut ffi::PyObject, depth: usize) -> Result<(), Refusal> {
    deeper(depth)?;
    wire::put_map(out, ffi::PyDict_Size(o) as usize)?;
    let mut pos: ffi::Py_ssize_t = 0;
    let mut k: *mut ffi::PyObject = std::ptr::null_mut();
    let mut v: *mut ffi::PyObject = std::ptr::null_mut();
    while ffi::PyDict_Next(o, &mut pos, &mut k, &mut v) != 0 {
        put(py, out, k, depth + 1)?;
        put(py, out, v, depth + 1)?;
    }
    Ok(())
}

unsafe fn put_seq(
    py: Python<'_>,
    out: &mut Vec<u8>,
    o: *mut ffi::PyObject,
    depth: usize,
    size: unsafe extern "C" fn(*mut ffi::PyObject) -> ffi::Py_ssize_t,
    item: unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject,
) -> Result<(), Refusal> {
    deeper(depth)?;
    let n = size(o);
    wire::put_array(out, n as usize)?;
    for i in 0..n {
        put(py, out, item(o, i), depth + 1)?;
    }
    Ok(())
}

#[pymethods]
impl Codec {
    #[new]
    fn new(
        request: &Bound<'_, PyType>,
        reply: &Bound<'_, PyType>,
        notification: &Bound<'_, PyType>,
        from_wire: PyObject,
        remote_error: PyObject,
        local_error: PyObject,
        max_fds: usize,
    ) -> PyResult<Self> {
        Ok(Codec {
            request: Class::new(request, &["id", "op", "args", "fds"])?,
            reply: Class::new(reply, &["id", "error", "result", "fds"])?,
            notification: Class::new(notification, &["op", "args", "fds"])?,
            from_wire,
            remote_error,
            local_error,
            max_fds,
        })
    }

    /// The message in `buffer[start:end]`, a frame's body, with the frame's fds.
    ///
    /// Raises:
    ///     RemoteProtocolError: the body is not msgpack of ours, or not a message (from_wire's words).
    fn decode<'py>(
        &self,
        py: Python<'py>,
        buffer: &Bound<'py, PyAny>,
        start: usize,
        end: usize,
        fds: &Bound<'py, PyAny>,
        limit: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let view = View::of(buffer)?;
        let Some(body) = view.bytes().get(start..end) else {
            return Err(PyValueError::new_err("the body's range lies outside the buffer"));
        };
        self.decode_body(py, body, fds, limit)
    }

    /// The whole frame for `message`: header (body length, fd count) and body.
    ///
    /// Raises:
    ///     LocalProtocolError: the message cannot be encoded, or its body exceeds `limit` bytes.
    fn encode<'py>(&self, py: Python<'py>, message: &Bound<'py, PyAny>, limit: usize) -> PyResult<Bound<'py, PyBytes>> {
        self.guarded(py, &self.local_error, "cannot encode", || self.encode_frame(py, message, limit))
    }
}

// -- frames -------------------------------------------------------------------------------------------------

/// The 8-byte frame header: body length, number of fds, both u32 little-endian.
const HEADER: usize = 8;

/// The bytes a connection received and has not yet taken as frames, and where they lie in the stream (the
/// fds that came with them are claimed by stream offset, in Python: `Connection._claim`).
#[pyclass(module = "mpsd_protocol._wire")]
pub struct Frames {
    codec: Py<Codec>,
    max_fds: u32,
    buf: Vec<u8>,
    /// Bytes of `buf` already taken.
    start: usize,
    /// Stream offset of `buf[0]`.
    offset: u64,
    /// Bodies of frames the caller has seen before, each with its token (`remember`, `repeats`).
    memo: FxHashMap<Box<[u8]>, PyObject>,
    /// The body of the frame `next` decoded last, if it may be remembered (no fds, at most MEMO_BODY bytes).
    last: Vec<u8>,
    has_last: bool,
}

/// The largest body a connection remembers (a launch notification's is about 70 bytes), and how many it
/// remembers before it starts again from none: a client's loop repeats a few calls, not thousands.
const MEMO_BODY: usize = 256;
const MEMO_FRAMES: usize = 64;

impl Frames {
    /// The header at `start`: (body length, fds), checked against the limits; None while incomplete.
    fn header(&self, py: Python<'_>, limit: usize) -> PyResult<Option<(usize, u32)>> {
        let Some(h) = self.buf.get(self.start..self.start + HEADER) else { return Ok(None) };
        let length = u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) as usize;
        let nfds = u32::from_le_bytes(h[4..].try_into().expect("4 bytes"));
        let codec = self.codec.get();
        if length > limit {
            return Err(codec.error(py, &codec.remote_error,
                                   format!("frame of {length} bytes exceeds the limit of {limit}")));
        }
        if nfds > self.max_fds {
            return Err(codec.error(py, &codec.remote_error,
                                   format!("frame claims {nfds} file descriptors; the limit is {}", self.max_fds)));
        }
        Ok(Some((length, nfds)))
    }

    /// Decode the frame of `length` at `start` with `fds`, and take it (as one `remember` may name, if
    /// `memo`).
    fn take_frame<'py>(&mut self, py: Python<'py>, length: usize, fds: &Bound<'py, PyAny>, limit: usize,
                       memo: bool) -> PyResult<Bound<'py, PyAny>> {
        let body = self.start + HEADER;
        let end = body + length;
        let message = self.codec.get().decode_body(py, &self.buf[body..end], fds, limit);
        self.has_last = memo && length <= MEMO_BODY;
        if self.has_last {
            self.last.clear();
            self.last.extend_from_slice(&self.buf[body..end]);
        }
        self.consume(end);
        message
    }

    /// Take the bytes of `buf` up to `end`.
    fn consume(&mut self, end: usize) {
        if end == self.buf.len() {
            // The common case: everything received has been taken.
            self.offset += end as u64;
            self.buf.clear();
            self.start = 0;
            if self.buf.capacity() > 1 << 20 {
                self.buf.shrink_to(1 << 16);
            }
        } else {
            self.start = end;
            if end > 1 << 16 && end * 2 > self.buf.len() {
                self.offset += end as u64;
                self.buf.drain(..end);
                self.start = 0;
            }
        }
    }
}

#[pymethods]
impl Frames {
    #[new]
    fn new(codec: Py<Codec>) -> Self {
        let max_fds = codec.get().max_fds as u32;
        Frames { codec, max_fds, buf: Vec::new(), start: 0, offset: 0, memo: FxHashMap::default(), last: Vec::new(),
                 has_last: false }
    }

    /// Append bytes received (any bytes-like object).
    fn feed(&mut self, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let view = View::of(data)?;
        self.buf.extend_from_slice(view.bytes());
        Ok(())
    }

    /// Forget every byte received and not taken.
    fn clear(&mut self) {
        self.offset += self.buf.len() as u64;
        self.buf = Vec::new();
        self.start = 0;
        self.forget();
    }

    /// Remember the body of the frame `next` decoded last as `token`, so that frames repeating it byte for byte
    /// come back from `repeats` undecoded; false, remembering nothing, where that frame had fds or a body
    /// over MEMO_BODY bytes. The caller says what a repeat means: the same bytes are the same message.
    fn remember(&mut self, token: PyObject) -> bool {
        if !std::mem::take(&mut self.has_last) {
            return false;
        }
        if self.memo.len() >= MEMO_FRAMES {
            self.memo.clear();
        }
        self.memo.insert(self.last.as_slice().into(), token);
        true
    }

    /// Forget every frame remembered.
    fn forget(&mut self) {
        self.memo.clear();
        self.has_last = false;
    }

    /// The complete frames at the head of what was received that repeat one remembered frame, without fds, up
    /// to `most` of them: taken undecoded, as (its token, how many). None, taking nothing, where the next
    /// frame is not one (incomplete, over `limit`, with fds, or not remembered); the frames after a run of
    /// one token are left for the next call.
    fn repeats(&mut self, py: Python<'_>, limit: usize, most: usize) -> Option<(PyObject, usize)> {
        let mut at = self.start;
        let mut count = 0;
        let mut token: Option<&PyObject> = None;
        while count < most {
            let Some(h) = self.buf.get(at..at + HEADER) else { break };
            let length = u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) as usize;
            let nfds = u32::from_le_bytes(h[4..].try_into().expect("4 bytes"));
            let end = at + HEADER + length;
            if nfds != 0 || length > limit.min(MEMO_BODY) || end > self.buf.len() {
                break;
            }
            let Some(t) = self.memo.get(&self.buf[at + HEADER..end]) else { break };
            if token.is_some_and(|first| !first.is(t)) {
                break;
            }
            token = Some(t);
            count += 1;
            at = end;
        }
        let token = token?.clone_ref(py);
        self.has_last = false;
        self.consume(at);
        Some((token, count))
    }

    /// The stream offset just past the bytes received.
    #[getter]
    fn end(&self) -> u64 {
        self.offset + self.buf.len() as u64
    }

    /// Bytes received and not yet taken.
    #[getter]
    fn pending(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next frame's message; None while the frame is incomplete. A frame with fds, or any frame while
    /// `claim` is true (the connection's batches: fds wait for the frames that will claim them), is not taken: its (stream offset of its first
    /// byte, of its end, fds it declares) come back, for its fds to be claimed and `take` to finish it.
    ///
    /// Raises:
    ///     RemoteProtocolError: the header breaks a limit, or the body is not a message.
    fn next<'py>(&mut self, py: Python<'py>, limit: usize, claim: &Bound<'py, PyAny>)
                 -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some((length, nfds)) = self.header(py, limit)? else { return Ok(None) };
        if self.buf.len() - self.start - HEADER < length {
            return Ok(None);
        }
        if nfds > 0 || claim.is_truthy()? {
            let first = self.offset + self.start as u64;
            let end = first + (HEADER + length) as u64;
            return Ok(Some((first, end, nfds).into_pyobject(py)?.into_any()));
        }
        let none = pyo3::types::PyTuple::empty(py);
        self.take_frame(py, length, none.as_any(), limit, true).map(Some)
    }

    /// The message of the frame `next` left for its fds to be claimed, with them.
    fn take<'py>(&mut self, py: Python<'py>, fds: &Bound<'py, PyAny>, limit: usize) -> PyResult<Bound<'py, PyAny>> {
        match self.header(py, limit)? {
            Some((length, _)) if self.buf.len() - self.start - HEADER >= length => {
                self.take_frame(py, length, fds, limit, false)
            }
            _ => Err(PyValueError::new_err("no complete frame to take")),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Codec>()?;
    m.add_class::<Frames>()?;
    m.add("MAX_DEPTH", MAX_DEPTH)?;
    Ok(())
}
