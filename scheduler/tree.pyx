# cython: language_level=3
"""The token-tree scheduler: a bounded token tree as flat typed arrays, and the verification walks.

Built into ``swiftspec_mpi._tree`` by setup.py (boundscheck and wraparound are off, so every
public entry point validates its inputs before touching memory). Everything here is pure
bookkeeping on small arrays: the draft group keeps a :class:`TokenTree`, the verify group only
uses the module-level functions on the subtree it receives. Inner loops run without the GIL.

Tree storage (one entry per node, node ids ``0 .. size-1``; node 0 is the root):

=============  ========  ==================================================================
array          dtype     meaning
=============  ========  ==================================================================
token          int64     the token of the node; the root is the last committed token
parent         int32     parent node id, -1 for the root
depth          int32     0 for the root, parent depth + 1 otherwise
logprob        float64   draft log-probability of the token given its parent (root: 0)
score          float64   cumulative log-probability from the root (root: 0), summed
                         root-to-node in float64: score = score[parent] + logprob
kv_slot        int32     slot of the node's draft KV, -1 while its KV was never computed
state          int8      STATE_ACCEPTED for the root (it is committed), STATE_SENT for nodes
                         handed to the verify group by ``best_subtree``, STATE_ALIVE otherwise
expanded       bool      the node was forwarded (``assign_slots``); it has a kv_slot and its
                         children, if any, were added by ``expand``
=============  ========  ==================================================================

Nodes are stored in topological order (every parent id is smaller than its children's ids) and
the ``k`` children of one ``expand`` are contiguous, in the order of the top-k columns.

Ordering of nodes by "goodness", used everywhere a choice is made: higher score first, then lower
depth, then lower node id. With log-probabilities <= 0 a parent always ranks before its child.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t
from libc.string cimport memcpy, memset
from libc.stdlib cimport free, malloc
from libc.math cimport isnan
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer

import numpy as np

STATE_ALIVE = 0
STATE_SENT = 1
STATE_ACCEPTED = 2

cdef enum:
    _ALIVE = 0
    _SENT = 1
    _ACCEPTED = 2

cdef int32_t _INT32_MAX = 2147483647

ctypedef fused real_t:
    float
    double


# ----------------------------------------------------------------------------------------------
# small helpers


cdef inline char* _data(object arr) except? NULL:
    """Data pointer of a C-contiguous numpy array (the caller keeps ``arr`` alive and has
    checked its dtype). Cheaper than a typed memoryview: no memoryview object is created."""
    cdef Py_buffer view
    PyObject_GetBuffer(arr, &view, PyBUF_SIMPLE)
    cdef char* data = <char*>view.buf
    PyBuffer_Release(&view)
    return data


cdef inline int64_t* _i64_ptr(object arr) except? NULL:
    return <int64_t*>_data(arr)


cdef inline int32_t* _i32_ptr(object arr) except? NULL:
    return <int32_t*>_data(arr)


cdef inline double* _f64_ptr(object arr) except? NULL:
    return <double*>_data(arr)


cdef inline int8_t* _i8_ptr(object arr) except? NULL:
    return <int8_t*>_data(arr)


cdef inline uint8_t* _u8_ptr(object arr) except? NULL:
    return <uint8_t*>_data(arr)


_DT_I32 = np.dtype(np.int32)
_DT_I64 = np.dtype(np.int64)
_DT_F32 = np.dtype(np.float32)
_DT_F64 = np.dtype(np.float64)


cdef object _as_array(object values, object dtype, int ndim, str name):
    """``values`` as a C-contiguous ``ndim``-D numpy array of ``dtype``: returned as is when it
    already is one (checked through the buffer protocol, ~0.1 us), else converted (copy)."""
    cdef Py_buffer view
    cdef bint ready = False
    if type(values) is np.ndarray and values.dtype is dtype:
        try:
            PyObject_GetBuffer(values, &view, PyBUF_C_CONTIGUOUS)
        except (BufferError, ValueError):
            pass
        else:
            ready = view.ndim == ndim
            PyBuffer_Release(&view)
    if ready:
        return values
    arr = np.ascontiguousarray(values, dtype=dtype)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr


cdef object _as_1d(object values, object dtype, str name):
    """``values`` as a C-contiguous 1-D numpy array of ``dtype`` (no copy when it already is)."""
    return _as_array(values, dtype, 1, name)


cdef object _as_real_2d(object values, str name):
    """``values`` as a C-contiguous 2-D float32 array if it is float32, else float64."""
    if type(values) is not np.ndarray:
        values = np.asarray(values)
    return _as_array(values, _DT_F32 if values.dtype == _DT_F32 else _DT_F64, 2, name)


cdef object _readonly(object view):
    view.flags.writeable = False
    return view


def _node_view(str name, str doc):
    """A read-only property of TokenTree: a read-only view of node array `name` (`doc`: its
    dtype, length and meaning)."""
    def get(TokenTree tree):
        return tree._node_array(name)
    return property(get, doc="Read-only " + doc + " (valid until the next mutating call).")


cdef inline bint _better(int32_t a, int32_t b, const double* score,
                         const int32_t* depth) noexcept nogil:
    """True iff node a ranks before node b: higher score, then lower depth, then lower id."""
    if score[a] != score[b]:
        return score[a] > score[b]
    if depth[a] != depth[b]:
        return depth[a] < depth[b]
    return a < b


cdef inline void _heap_push(int32_t* heap, int* heap_len, int32_t node, const double* score,
                            const int32_t* depth) noexcept nogil:
    cdef int pos = heap_len[0]
    cdef int up
    heap_len[0] += 1
    while pos > 0:
        up = (pos - 1) >> 1
        if not _better(node, heap[up], score, depth):
            break
        heap[pos] = heap[up]
        pos = up
    heap[pos] = node


cdef inline int32_t _heap_pop(int32_t* heap, int* heap_len, const double* score,
                              const int32_t* depth) noexcept nogil:
    cdef int32_t top = heap[0]
    cdef int n = heap_len[0] - 1
    cdef int32_t last = heap[n]
    cdef int pos = 0
    cdef int child
    heap_len[0] = n
    if n == 0:
        return top
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        if child + 1 < n and _better(heap[child + 1], heap[child], score, depth):
            child += 1
        if not _better(heap[child], last, score, depth):
            break
        heap[pos] = heap[child]
        pos = child
    heap[pos] = last
    return top


# ----------------------------------------------------------------------------------------------
# the draft-side tree


cdef class TokenTree:
    """A token tree of bounded capacity, kept by the draft group.

    Args:
        capacity: the most nodes the tree can hold (root included), >= 1.
        max_depth: nodes at depth >= max_depth are never selected for expansion, so no node is
            deeper than max_depth; >= 1.

    A new tree holds only a root with token 0 at position 0; call :meth:`reset` first.
    Not thread-safe: one thread owns a tree (the inner loops drop the GIL only so that other
    Python threads, e.g. a poller, can run meanwhile).
    """

    cdef readonly int capacity
    cdef readonly int max_depth
    cdef int _size
    cdef int64_t _root_pos
    cdef int _num_expanded
    cdef int _last_k
    cdef bint _prefix_kv_missing
    cdef int32_t _epoch

    cdef object _a_token, _a_parent, _a_depth, _a_logprob, _a_score, _a_kv_slot
    cdef object _a_state, _a_expanded, _a_first_child, _a_num_children
    cdef object _node_arrays      # name -> the node array the read-only view properties slice
    cdef object _a_work, _a_index, _a_mark

    cdef int64_t* _token
    cdef int32_t* _parent
    cdef int32_t* _depth
    cdef double* _logprob
    cdef double* _score
    cdef int32_t* _kv_slot
    cdef int8_t* _state
    cdef uint8_t* _expanded
    cdef int32_t* _first_child    # id of the first child, -1 before expand
    cdef int32_t* _num_children
    cdef int32_t* _work           # scratch: top-w buffer, heap, reroot path
    cdef int32_t* _index          # scratch: old id -> new id (reroot), node -> local (subtree)
    cdef int32_t* _mark           # scratch: duplicate detection, compared with _epoch

    def __cinit__(self, int capacity, int max_depth):
        if capacity < 1:
            raise ValueError(f"TokenTree capacity must be >= 1, got {capacity}")
        if max_depth < 1:
            raise ValueError(f"TokenTree max_depth must be >= 1, got {max_depth}")
        self.capacity = capacity
        self.max_depth = max_depth
        self._a_token = np.zeros(capacity, np.int64)
        self._a_parent = np.zeros(capacity, np.int32)
        self._a_depth = np.zeros(capacity, np.int32)
        self._a_logprob = np.zeros(capacity, np.float64)
        self._a_score = np.zeros(capacity, np.float64)
        self._a_kv_slot = np.zeros(capacity, np.int32)
        self._a_state = np.zeros(capacity, np.int8)
        self._a_expanded = np.zeros(capacity, np.uint8)
        self._a_first_child = np.zeros(capacity, np.int32)
        self._a_num_children = np.zeros(capacity, np.int32)
        self._a_work = np.zeros(capacity, np.int32)
        self._a_index = np.zeros(capacity, np.int32)
        self._a_mark = np.zeros(capacity, np.int32)
        self._node_arrays = {"_a_token": self._a_token, "_a_parent": self._a_parent,
                             "_a_depth": self._a_depth, "_a_logprob": self._a_logprob,
                             "_a_score": self._a_score, "_a_kv_slot": self._a_kv_slot,
                             "_a_state": self._a_state,
                             "_a_expanded": self._a_expanded.view(np.bool_)}
        self._token = _i64_ptr(self._a_token)
        self._parent = _i32_ptr(self._a_parent)
        self._depth = _i32_ptr(self._a_depth)
        self._logprob = _f64_ptr(self._a_logprob)
        self._score = _f64_ptr(self._a_score)
        self._kv_slot = _i32_ptr(self._a_kv_slot)
        self._state = _i8_ptr(self._a_state)
        self._expanded = _u8_ptr(self._a_expanded)
        self._first_child = _i32_ptr(self._a_first_child)
        self._num_children = _i32_ptr(self._a_num_children)
        self._work = _i32_ptr(self._a_work)
        self._index = _i32_ptr(self._a_index)
        self._mark = _i32_ptr(self._a_mark)
        self._epoch = 0
        self._last_k = 1
        self.reset(0, 0)

    # -- properties ------------------------------------------------------------------------

    @property
    def size(self):
        """Number of nodes (root included)."""
        return self._size

    @property
    def root_pos(self):
        """Absolute position of the root = number of committed tokens before it = committed KV
        prefix length P."""
        return self._root_pos

    @property
    def num_expanded(self):
        """Number of expanded nodes (each owns one draft KV slot)."""
        return self._num_expanded

    @property
    def prefix_kv_missing(self):
        """True iff the last :meth:`reroot` committed a node that was never forwarded (the last
        accepted draft node, or the old root when nothing was accepted), so the draft KV slot
        ``root_pos - 1`` holds no valid KV: the engine must forward that token (position and slot
        ``root_pos - 1``, seeing columns ``[0, root_pos)``) before or together with the root.
        Cleared by :meth:`reset` and by a :meth:`reroot` that does not leave such a hole."""
        return self._prefix_kv_missing

    # Read-only views of the first `size` entries of the node arrays (valid until the next
    # mutating call); `_node_view` below makes each property.
    token = _node_view("_a_token", "int64[size]: the node tokens")
    parent = _node_view("_a_parent", "int32[size]: the parent ids (-1 for the root)")
    depth = _node_view("_a_depth", "int32[size]: the depths (root 0)")
    logprob = _node_view("_a_logprob", "float64[size]: the edge log-probabilities (root 0)")
    score = _node_view("_a_score", "float64[size]: cumulative log-probabilities from the root")
    kv_slot = _node_view("_a_kv_slot", "int32[size]: the draft KV slots (-1: never computed)")
    state = _node_view("_a_state", "int8[size]: STATE_ALIVE / STATE_SENT / STATE_ACCEPTED")
    expanded = _node_view("_a_expanded", "bool[size]: the expanded flags")

    def _node_array(self, str name):
        """The node array `name` (one of the `_a_*` fields), its first `size` entries, read-only."""
        return _readonly(self._node_arrays[name][:self._size])

    def __repr__(self):
        return (f"TokenTree(size={self._size}, capacity={self.capacity}, "
                f"max_depth={self.max_depth}, root_pos={self._root_pos}, "
                f"num_expanded={self._num_expanded})")

    # -- internal --------------------------------------------------------------------------

    cdef int32_t _next_epoch(self):
        self._epoch += 1
        if self._epoch == _INT32_MAX:
            memset(self._mark, 0, self.capacity * sizeof(int32_t))
            self._epoch = 1
        return self._epoch

    cdef object _check_nodes(self, const int32_t* nodes, Py_ssize_t n, str what, bint unique):
        """Raise ValueError unless every id in nodes[:n] is a node (and, if unique, no repeats)."""
        cdef Py_ssize_t i
        cdef int32_t node
        cdef int32_t epoch = self._next_epoch() if unique else 0
        for i in range(n):
            node = nodes[i]
            if node < 0 or node >= self._size:
                raise ValueError(f"{what}: node id {node} out of range [0, {self._size})")
            if unique:
                if self._mark[node] == epoch:
                    raise ValueError(f"{what}: node {node} appears twice")
                self._mark[node] = epoch

    # -- the draft cycle -------------------------------------------------------------------

    def reset(self, int64_t root_token, int64_t root_pos):
        """Drop everything; keep only a root.

        Args:
            root_token: the last committed token.
            root_pos: its absolute position = number of committed tokens before it, >= 0.

        After: size 1, the root is unexpanded (kv_slot -1), score 0, state STATE_ACCEPTED.
        """
        if root_pos < 0:
            raise ValueError(f"reset: root_pos must be >= 0, got {root_pos}")
        self._size = 1
        self._root_pos = root_pos
        self._num_expanded = 0
        self._prefix_kv_missing = False
        self._set_root(root_token)

    cdef void _set_root(self, int64_t token) noexcept nogil:
        """Node 0 becomes a lone accepted root holding `token` (no KV slot, not expanded)."""
        self._token[0] = token
        self._parent[0] = -1
        self._depth[0] = 0
        self._logprob[0] = 0.0
        self._score[0] = 0.0
        self._kv_slot[0] = -1
        self._state[0] = _ACCEPTED
        self._expanded[0] = 0
        self._first_child[0] = -1
        self._num_children[0] = 0

    def copy(self):
        """An independent TokenTree with the same capacity, max_depth and contents."""
        cdef TokenTree other = TokenTree(self.capacity, self.max_depth)
        cdef int n = self._size
        other._size = n
        other._root_pos = self._root_pos
        other._num_expanded = self._num_expanded
        other._last_k = self._last_k
        other._prefix_kv_missing = self._prefix_kv_missing
        memcpy(other._token, self._token, n * sizeof(int64_t))
        memcpy(other._parent, self._parent, n * sizeof(int32_t))
        memcpy(other._depth, self._depth, n * sizeof(int32_t))
        memcpy(other._logprob, self._logprob, n * sizeof(double))
        memcpy(other._score, self._score, n * sizeof(double))
        memcpy(other._kv_slot, self._kv_slot, n * sizeof(int32_t))
        memcpy(other._state, self._state, n * sizeof(int8_t))
        memcpy(other._expanded, self._expanded, n * sizeof(uint8_t))
        memcpy(other._first_child, self._first_child, n * sizeof(int32_t))
        memcpy(other._num_children, self._num_children, n * sizeof(int32_t))
        return other

    def select_leaves(self, int w, int k=0):
        """The best unexpanded nodes, to be forwarded and expanded next.

        Args:
            w: the most nodes to return, >= 0.
            k: children each selected node will get from :meth:`expand` (for the capacity
               check); 0 (default) means the ``k`` of the last :meth:`expand` (1 before any).

        Returns:
            int32[n], n <= w: unexpanded nodes with depth < max_depth, best first (higher score,
            then lower depth, then lower id). Empty when ``size + n * k > capacity`` (the tree
            is full until the next :meth:`reroot`) or when no node qualifies.
        """
        if w < 0:
            raise ValueError(f"select_leaves: w must be >= 0, got {w}")
        if k < 0:
            raise ValueError(f"select_leaves: k must be >= 0, got {k}")
        cdef int per_leaf = k if k > 0 else self._last_k
        cdef int n = 0
        cdef int i, pos
        cdef int size = self._size
        cdef int32_t* buf = self._work
        cdef const double* score = self._score
        cdef const int32_t* depth = self._depth
        if w > size:
            w = size
        with nogil:
            for i in range(size):
                if self._expanded[i] or depth[i] >= self.max_depth:
                    continue
                if n < w:
                    pos = n
                    n += 1
                elif n > 0 and _better(i, buf[n - 1], score, depth):
                    pos = n - 1
                else:
                    continue
                while pos > 0 and _better(i, buf[pos - 1], score, depth):
                    buf[pos] = buf[pos - 1]
                    pos -= 1
                buf[pos] = i
        if <int64_t>n * per_leaf > self.capacity - size:
            n = 0
        out = np.empty(n, _DT_I32)
        if n:
            memcpy(_i32_ptr(out), buf, n * sizeof(int32_t))
        return out

    def assign_slots(self, leaves, int64_t first_slot):
        """Give nodes their draft KV slots and mark them expanded (they are being forwarded).

        Args:
            leaves: int32[n] unexpanded node ids, no repeats (usually from :meth:`select_leaves`).
            first_slot: slot of leaves[0]; leaves[i] gets ``first_slot + i``. Must be >= root_pos
                (slots below hold the committed prefix); the engine passes
                ``root_pos + num_expanded``.
        """
        arr = _as_1d(leaves, _DT_I32, "assign_slots: leaves")
        cdef Py_ssize_t n = arr.shape[0]
        if n == 0:
            return
        cdef int32_t* ids = _i32_ptr(arr)
        cdef Py_ssize_t i
        if first_slot < self._root_pos:
            raise ValueError(f"assign_slots: first_slot {first_slot} is inside the committed "
                             f"prefix [0, {self._root_pos})")
        if first_slot + n - 1 > _INT32_MAX:
            raise ValueError(f"assign_slots: slots beyond int32 range (first_slot {first_slot})")
        self._check_nodes(ids, n, "assign_slots", True)
        for i in range(n):
            if self._expanded[ids[i]]:
                raise ValueError(f"assign_slots: node {ids[i]} is already expanded "
                                 f"(kv_slot {self._kv_slot[ids[i]]})")
        for i in range(n):
            self._kv_slot[ids[i]] = <int32_t>(first_slot + i)
            self._expanded[ids[i]] = 1
        self._num_expanded += <int>n

    def masks(self, leaves, int64_t ncols):
        """Position ids and attention mask for forwarding ``leaves`` over the draft KV.

        Args:
            leaves: int32[n] node ids (usually just given slots by :meth:`assign_slots`).
            ncols: number of KV columns the forward attends over (``first_slot + n``);
                must be >= root_pos and > every kv_slot on the leaves' root paths.

        Returns:
            positions: int64[n], ``root_pos + depth[leaves[i]]``.
            mask: bool[n, ncols]; ``mask[i, j]`` is True iff ``j < root_pos`` (committed prefix)
            or j is the kv_slot of leaves[i] or of one of its ancestors (root included).
        """
        arr = _as_1d(leaves, _DT_I32, "masks: leaves")
        cdef Py_ssize_t n = arr.shape[0]
        cdef int32_t* ids = _i32_ptr(arr) if n else NULL
        if ncols < self._root_pos:
            raise ValueError(f"masks: ncols {ncols} < root_pos {self._root_pos}")
        self._check_nodes(ids, n, "masks", False)
        positions = np.empty(n, _DT_I64)
        mask_arr = np.empty((n, ncols), np.bool_)
        if n == 0:
            return positions, mask_arr
        cdef int64_t* pos = _i64_ptr(positions)
        cdef uint8_t* mask = _u8_ptr(mask_arr) if ncols else NULL
        cdef uint8_t* row
        cdef Py_ssize_t i
        cdef int32_t node, slot
        cdef int64_t bad_slot = -1
        with nogil:
            for i in range(n):
                node = ids[i]
                pos[i] = self._root_pos + self._depth[node]
                row = mask + i * ncols if ncols else NULL
                if ncols:
                    memset(row, 1, self._root_pos)
                    memset(row + self._root_pos, 0, ncols - self._root_pos)
                while node >= 0:
                    slot = self._kv_slot[node]
                    if slot >= ncols:
                        bad_slot = slot
                        break
                    if slot >= 0:
                        row[slot] = 1
                    node = self._parent[node]
                if bad_slot >= 0:
                    break
        if bad_slot >= 0:
            raise ValueError(f"masks: kv_slot {bad_slot} of node {node} (on the root path of "
                             f"leaves[{i}]) is >= ncols {ncols}")
        return positions, mask_arr

    def expand(self, leaves, topk_ids, topk_logprobs):
        """Add the draft's top-k children under each forwarded leaf.

        Args:
            leaves: int32[n] expanded (slot-assigned) nodes without children yet, depth <
                max_depth, no repeats.
            topk_ids: int64[n, k], k >= 1: child tokens of leaves[i] in row i.
            topk_logprobs: float32 or float64 [n, k]: their draft log-probabilities (no NaN;
                -inf allowed).

        Returns:
            int32[n * k]: ids of the new nodes, ``size_before + i * k + j`` for column j of row
            i (children of one leaf are contiguous). Each child: depth = leaf depth + 1,
            score = leaf score + logprob (float64), kv_slot -1, unexpanded, STATE_ALIVE.

        Raises:
            ValueError: bad shapes or ids, a leaf not expanded / already expanded with children,
                NaN log-probabilities, or ``size + n * k > capacity`` (tree unchanged).
        """
        leaf_arr = _as_1d(leaves, _DT_I32, "expand: leaves")
        ids_arr = _as_array(topk_ids, _DT_I64, 2, "expand: topk_ids")
        lp_arr = _as_real_2d(topk_logprobs, "expand: topk_logprobs")
        cdef Py_ssize_t n = leaf_arr.shape[0]
        if ids_arr.shape[0] != n or lp_arr.shape[0] != n or ids_arr.shape[1] != lp_arr.shape[1]:
            raise ValueError(f"expand: need topk_ids and topk_logprobs of shape [n={n}, k], got "
                             f"{ids_arr.shape} and {lp_arr.shape}")
        cdef Py_ssize_t k = ids_arr.shape[1]
        if k < 1:
            raise ValueError("expand: k (columns of topk_ids) must be >= 1")
        if n == 0:
            return np.empty(0, _DT_I32)
        cdef int32_t* ids = _i32_ptr(leaf_arr)
        cdef Py_ssize_t i
        cdef int32_t node
        self._check_nodes(ids, n, "expand", True)
        for i in range(n):
            node = ids[i]
            if not self._expanded[node]:
                raise ValueError(f"expand: node {node} has no KV slot; call assign_slots first")
            if self._first_child[node] >= 0:
                raise ValueError(f"expand: node {node} already has children")
            if self._depth[node] >= self.max_depth:
                raise ValueError(f"expand: node {node} is at depth {self._depth[node]} >= "
                                 f"max_depth {self.max_depth}")
        if self._size + n * k > self.capacity:
            raise ValueError(f"expand: TokenTree capacity {self.capacity} exceeded: size "
                             f"{self._size} + {n} leaves x {k} children; reroot or use a larger "
                             f"capacity")
        cdef int first_new = self._size
        cdef const int64_t* tok = _i64_ptr(ids_arr)
        cdef Py_ssize_t bad
        if lp_arr.dtype is _DT_F32:
            bad = self._expand_impl(ids, n, k, tok, <const float*>_data(lp_arr))
        else:
            bad = self._expand_impl(ids, n, k, tok, <const double*>_data(lp_arr))
        if bad >= 0:
            raise ValueError(f"expand: topk_logprobs[{bad // k}, {bad % k}] is NaN")
        self._last_k = <int>k
        return np.arange(first_new, first_new + n * k, dtype=np.int32)

    cdef Py_ssize_t _expand_impl(self, const int32_t* ids, Py_ssize_t n, Py_ssize_t k,
                                 const int64_t* tok, const real_t* lp):
        """Append the children; return -1, or the flat index of a NaN (tree unchanged then)."""
        cdef Py_ssize_t i, j
        cdef int32_t node, child
        cdef double leaf_score
        with nogil:
            for i in range(n):
                for j in range(k):
                    if isnan(lp[i * k + j]):
                        return i * k + j
            child = self._size
            for i in range(n):
                node = ids[i]
                leaf_score = self._score[node]
                self._first_child[node] = child
                self._num_children[node] = <int32_t>k
                for j in range(k):
                    self._token[child] = tok[i * k + j]
                    self._parent[child] = node
                    self._depth[child] = self._depth[node] + 1
                    self._logprob[child] = <double>lp[i * k + j]
                    self._score[child] = leaf_score + <double>lp[i * k + j]
                    self._kv_slot[child] = -1
                    self._state[child] = _ALIVE
                    self._expanded[child] = 0
                    self._first_child[child] = -1
                    self._num_children[child] = 0
                    child += 1
            self._size = child
        return -1

    def best_subtree(self, int bs):
        """The ``bs`` best nodes forming a connected subtree that contains the root.

        Args:
            bs: budget, >= 1 (the verify batch size).

        Returns:
            nodes: int32[min(bs, size)], nodes[0] == 0 (the root), in best-first order: each
                next node is the best (higher score, lower depth, lower id) child of an already
                chosen node. With log-probabilities <= 0 this is exactly the order
                (score desc, depth asc, id asc) over the whole tree; it is always topological.
            parents_local: int32[same], -1 for the root, else the index in ``nodes`` of the
                node's parent.

        Marks every returned non-root node STATE_SENT (informational; the draft keeps
        expanding anything).
        """
        if bs < 1:
            raise ValueError(f"best_subtree: bs must be >= 1, got {bs}")
        cdef int n = bs if bs < self._size else self._size
        nodes = np.empty(n, _DT_I32)
        parents_local = np.empty(n, _DT_I32)
        cdef int32_t* out_nodes = _i32_ptr(nodes)
        cdef int32_t* out_parents = _i32_ptr(parents_local)
        cdef int32_t* heap = self._work
        cdef int32_t* local_of = self._index
        cdef const double* score = self._score
        cdef const int32_t* depth = self._depth
        cdef int heap_len = 0
        cdef int count = 0
        cdef int32_t x, c, c_end
        with nogil:
            _heap_push(heap, &heap_len, 0, score, depth)
            while count < n and heap_len > 0:
                x = _heap_pop(heap, &heap_len, score, depth)
                local_of[x] = count
                out_nodes[count] = x
                if x == 0:
                    out_parents[count] = -1
                else:
                    out_parents[count] = local_of[self._parent[x]]
                    self._state[x] = _SENT
                count += 1
                c = self._first_child[x]
                if c >= 0:
                    c_end = c + self._num_children[x]
                    while c < c_end:
                        _heap_push(heap, &heap_len, c, score, depth)
                        c += 1
        return nodes, parents_local

    def tokens_of(self, nodes):
        """int64[n]: the tokens of node ids ``nodes`` (int32[n])."""
        arr = _as_1d(nodes, _DT_I32, "tokens_of: nodes")
        cdef Py_ssize_t n = arr.shape[0]
        out = np.empty(n, _DT_I64)
        if n == 0:
            return out
        cdef int32_t* ids = _i32_ptr(arr)
        cdef int64_t* tok = _i64_ptr(out)
        cdef Py_ssize_t i
        self._check_nodes(ids, n, "tokens_of", False)
        for i in range(n):
            tok[i] = self._token[ids[i]]
        return out

    def reroot(self, accepted_tokens):
        """Commit what the target accepted and keep the subtree under its bonus token.

        Args:
            accepted_tokens: int64[k], k >= 1: the k-1 draft tokens the target accepted along a
                path from the root (each a child of the previous node), then the target's bonus
                token.

        Effect: the root and the k-1 accepted nodes are committed; ``root_pos += k``. If the
        last accepted node has a child whose token is the bonus (the first such child by id),
        it becomes the new root (node 0) and all its descendants survive, renumbered by keeping
        their relative order (topological); depth, score (summed from the new root) follow.
        Otherwise the tree becomes only the new root (token = bonus, unexpanded). All other
        nodes are dropped. The root is STATE_ACCEPTED, survivors STATE_ALIVE (the verification
        in flight has returned).

        Returns:
            kv_src, kv_dst: int64[m] each, the draft KV moves, only where src != dst, to be
                applied simultaneously (gather every src, then scatter to dst):
                the committed nodes' KV goes to ``[old root_pos, new root_pos)`` in path order,
                then the surviving expanded nodes' KV to ``[new root_pos, new root_pos + e)`` in
                new node order (e = num_expanded afterwards). Listed in that order.
            new_root_pos: int, old root_pos + k.
            root_needs_forward: bool, True iff the new root is unexpanded (has no KV yet).

        If the last committed node was never forwarded (no KV slot), its slot
        ``new_root_pos - 1`` gets no move and :attr:`prefix_kv_missing` becomes True.

        Raises:
            ValueError: k == 0, or an accepted draft token is not a child of the previous node
                (the tree is unchanged then).
        """
        acc_arr = _as_1d(accepted_tokens, _DT_I64, "reroot: accepted_tokens")
        cdef Py_ssize_t k = acc_arr.shape[0]
        if k < 1:
            raise ValueError("reroot: accepted_tokens must hold at least the bonus token")
        if k - 1 > self.max_depth:
            raise ValueError(f"reroot: {k - 1} accepted draft tokens exceed max_depth "
                             f"{self.max_depth}")
        cdef const int64_t* acc = _i64_ptr(acc_arr)
        cdef int32_t* path = self._work
        cdef Py_ssize_t i
        cdef int32_t cur = 0, c, c_end, found
        # 1. the accepted path
        path[0] = 0
        for i in range(k - 1):
            found = -1
            c = self._first_child[cur]
            if c >= 0:
                c_end = c + self._num_children[cur]
                while c < c_end:
                    if self._token[c] == acc[i]:
                        found = c
                        break
                    c += 1
            if found < 0:
                raise ValueError(f"reroot: accepted token {acc[i]} (index {i}) is not a child "
                                 f"of node {cur} (token {self._token[cur]}, depth "
                                 f"{self._depth[cur]}); accepted_tokens must follow a tree path "
                                 f"from the root")
            cur = found
            path[i + 1] = cur
        cdef int64_t bonus = acc[k - 1]
        cdef int32_t new_root = -1
        c = self._first_child[cur]
        if c >= 0:
            c_end = c + self._num_children[cur]
            while c < c_end:
                if self._token[c] == bonus:
                    new_root = c
                    break
                c += 1
        # 2. the plan, sized for the worst case (k committed + every survivor)
        cdef int max_moves = <int>k + (self._size - new_root if new_root >= 0 else 0)
        src_arr = np.empty(max_moves, _DT_I64)
        dst_arr = np.empty(max_moves, _DT_I64)
        cdef int64_t* src = _i64_ptr(src_arr)
        cdef int64_t* dst = _i64_ptr(dst_arr)
        cdef int moves = 0
        cdef int64_t old_root_pos = self._root_pos
        cdef int64_t new_root_pos = old_root_pos + k
        cdef bint missing = False
        cdef int32_t node, slot
        for i in range(k):
            node = path[i]
            if self._expanded[node]:
                slot = self._kv_slot[node]
                if slot != old_root_pos + i:
                    src[moves] = slot
                    dst[moves] = old_root_pos + i
                    moves += 1
            else:
                missing = True   # only the last committed node can be unexpanded
        # 3. compact the surviving subtree in place (new id <= old id, so reads stay ahead)
        cdef int32_t* new_id = self._index
        cdef int size = self._size
        cdef int count = 0
        cdef int expanded_count = 0
        cdef int32_t p, old_first
        cdef int64_t target
        cdef int32_t root_depth
        if new_root >= 0:
            root_depth = self._depth[new_root]
            with nogil:
                for i in range(new_root, size):
                    new_id[i] = -1
                for i in range(new_root, size):
                    if i == new_root:
                        p = -1
                    else:
                        p = self._parent[i]
                        if p < new_root or new_id[p] < 0:
                            continue
                        p = new_id[p]
                    node = count
                    new_id[i] = node
                    count += 1
                    if self._expanded[i]:
                        target = new_root_pos + expanded_count
                        expanded_count += 1
                        if self._kv_slot[i] != target:
                            src[moves] = self._kv_slot[i]
                            dst[moves] = target
                            moves += 1
                        self._kv_slot[node] = <int32_t>target
                    else:
                        self._kv_slot[node] = -1
                    self._token[node] = self._token[i]
                    self._parent[node] = p
                    self._depth[node] = self._depth[i] - root_depth
                    self._expanded[node] = self._expanded[i]
                    self._state[node] = _ALIVE
                    old_first = self._first_child[i]
                    self._num_children[node] = self._num_children[i]
                    # children come after their parent, so their new ids are set later: store the
                    # old id and fix it up below
                    self._first_child[node] = old_first
                    if p < 0:
                        self._logprob[node] = 0.0
                        self._score[node] = 0.0
                    else:
                        self._logprob[node] = self._logprob[i]
                        self._score[node] = self._score[p] + self._logprob[i]
                for i in range(count):
                    if self._first_child[i] >= 0:
                        self._first_child[i] = new_id[self._first_child[i]]
            self._state[0] = _ACCEPTED
            self._size = count
            self._num_expanded = expanded_count
        else:
            self._size = 1
            self._num_expanded = 0
            self._set_root(bonus)
        self._root_pos = new_root_pos
        self._prefix_kv_missing = missing
        return src_arr[:moves], dst_arr[:moves], new_root_pos, not self._expanded[0]


# ----------------------------------------------------------------------------------------------
# verification (verify group, on the received subtree only)


cdef object _check_parents(const int32_t* parents, Py_ssize_t n, str what):
    """Raise ValueError unless parents[0] == -1 and 0 <= parents[i] < i for i >= 1."""
    cdef Py_ssize_t i
    if n < 1:
        raise ValueError(f"{what}: the subtree needs at least the root")
    if parents[0] != -1:
        raise ValueError(f"{what}: parents_local[0] must be -1 (the root), got {parents[0]}")
    for i in range(1, n):
        if parents[i] < 0 or parents[i] >= i:
            raise ValueError(f"{what}: parents_local[{i}] = {parents[i]} is not a node before "
                             f"{i} (the subtree must be in topological order, root first)")


def subtree_masks(parents_local, int64_t root_pos):
    """Position ids and the square tree mask for the verify forward of a received subtree.

    Args:
        parents_local: int32[n], n >= 1, topological (parents_local[0] == -1, else
            0 <= parents_local[i] < i).
        root_pos: committed prefix length P (the root's position), >= 0.

    Returns:
        positions: int64[n], ``root_pos + depth_i``.
        mask: bool[n, root_pos + n]: the n nodes are written at slots root_pos + i; row i sees
            columns ``[0, root_pos)`` and ``root_pos + j`` for j = i and every ancestor of i.
    """
    arr = _as_1d(parents_local, _DT_I32, "subtree_masks: parents_local")
    cdef Py_ssize_t n = arr.shape[0]
    if root_pos < 0:
        raise ValueError(f"subtree_masks: root_pos must be >= 0, got {root_pos}")
    cdef const int32_t* parents = _i32_ptr(arr) if n else NULL
    _check_parents(parents, n, "subtree_masks")
    cdef Py_ssize_t ncols = root_pos + n
    positions = np.empty(n, _DT_I64)
    mask_arr = np.empty((n, ncols), np.bool_)
    cdef int64_t* pos = _i64_ptr(positions)
    cdef uint8_t* mask = _u8_ptr(mask_arr)
    cdef Py_ssize_t i
    with nogil:
        pos[0] = root_pos
        memset(mask, 1, root_pos)
        memset(mask + root_pos, 0, n)
        mask[root_pos] = 1
        for i in range(1, n):
            pos[i] = pos[parents[i]] + 1
            memcpy(mask + i * ncols, mask + parents[i] * ncols, ncols)
            mask[i * ncols + root_pos + i] = 1
    return positions, mask_arr


def verify_greedy(tokens, parents_local, target_argmax):
    """Greedy verification: the longest root path on which the target agrees with the draft.

    Args:
        tokens: int64[n] node tokens (tokens[0] is the root's, unused).
        parents_local: int32[n], topological, parents_local[0] == -1.
        target_argmax: int64[n], the target's argmax next token after each node.

    Returns:
        path: int32[a], local indices from the root (path[0] == 0); a child is accepted iff its
            token == target_argmax[current] (the first such child in local order).
        accepted_tokens: int64[a], tokens[path[1:]] followed by the bonus
            target_argmax[path[-1]].
    """
    tok_arr = _as_1d(tokens, _DT_I64, "verify_greedy: tokens")
    par_arr = _as_1d(parents_local, _DT_I32, "verify_greedy: parents_local")
    arg_arr = _as_1d(target_argmax, _DT_I64, "verify_greedy: target_argmax")
    cdef Py_ssize_t n = par_arr.shape[0]
    if tok_arr.shape[0] != n or arg_arr.shape[0] != n:
        raise ValueError(f"verify_greedy: tokens {tok_arr.shape}, parents_local {par_arr.shape} "
                         f"and target_argmax {arg_arr.shape} must have the same length")
    cdef const int32_t* parents = _i32_ptr(par_arr) if n else NULL
    _check_parents(parents, n, "verify_greedy")
    cdef const int64_t* tok = _i64_ptr(tok_arr)
    cdef const int64_t* argmax = _i64_ptr(arg_arr)
    path_buf = np.empty(n, _DT_I32)
    cdef int32_t* path = _i32_ptr(path_buf)
    cdef Py_ssize_t a = 1, j
    cdef int32_t cur = 0
    cdef int64_t want
    cdef bint moved
    with nogil:
        path[0] = 0
        while True:
            want = argmax[cur]
            moved = False
            for j in range(cur + 1, n):
                if parents[j] == cur and tok[j] == want:
                    cur = <int32_t>j
                    path[a] = cur
                    a += 1
                    moved = True
                    break
            if not moved:
                break
    accepted = np.empty(a, _DT_I64)
    cdef int64_t* acc = _i64_ptr(accepted)
    for j in range(1, a):
        acc[j - 1] = tok[path[j]]
    acc[a - 1] = argmax[cur]
    return path_buf[:a], accepted


cdef inline double _row_sum(const real_t* row, Py_ssize_t vocab) noexcept nogil:
    """float64 sum of row[:vocab] in four interleaved lanes (lane = v % 4), combined as
    (lane0 + lane1) + (lane2 + lane3): four independent add chains instead of one."""
    cdef double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0
    cdef Py_ssize_t v = 0
    while v + 4 <= vocab:
        s0 += <double>row[v]
        s1 += <double>row[v + 1]
        s2 += <double>row[v + 2]
        s3 += <double>row[v + 3]
        v += 4
    if v < vocab:
        s0 += <double>row[v]
    if v + 1 < vocab:
        s1 += <double>row[v + 1]
    if v + 2 < vocab:
        s2 += <double>row[v + 2]
    return (s0 + s1) + (s2 + s3)


cdef Py_ssize_t _sample_walk(const real_t* probs, Py_ssize_t vocab, const int64_t* tok,
                             const int32_t* parents, Py_ssize_t n, const double* uniforms,
                             int32_t* path, int64_t* acc, int64_t* rejected) noexcept nogil:
    """The lossless multi-branch walk. Returns the path length a >= 1, or -(1 + row) when a
    visited row has no positive mass."""
    cdef Py_ssize_t a = 1, ui = 0, j, v, r, n_rej, insert_at
    cdef int32_t cur = 0
    cdef int64_t t, chosen, last_positive
    cdef double total, pc, u, threshold, running, best
    cdef bint moved, is_rejected
    cdef const real_t* row
    path[0] = 0
    while True:
        row = probs + cur * vocab
        total = _row_sum(row, vocab)
        if not total > 0.0:
            return -(1 + cur)
        n_rej = 0
        moved = False
        for j in range(cur + 1, n):
            if parents[j] != cur:
                continue
            t = tok[j]
            is_rejected = False
            for r in range(n_rej):
                if rejected[r] == t:
                    is_rejected = True
                    break
            pc = 0.0 if is_rejected else <double>row[t]
            u = uniforms[ui]
            ui += 1
            if pc > 0.0 and (pc >= total or u * total < pc):
                acc[a - 1] = t
                path[a] = <int32_t>j
                a += 1
                cur = <int32_t>j
                moved = True
                break
            if pc > 0.0:
                total -= pc
                insert_at = n_rej          # keep `rejected` sorted for the merge scan below
                while insert_at > 0 and rejected[insert_at - 1] > t:
                    rejected[insert_at] = rejected[insert_at - 1]
                    insert_at -= 1
                rejected[insert_at] = t
                n_rej += 1
        if moved:
            continue
        # bonus: inverse CDF of the residual (the row without the rejected tokens)
        threshold = uniforms[ui] * total
        running = 0.0
        chosen = -1
        last_positive = -1
        r = 0
        for v in range(vocab):
            if r < n_rej and rejected[r] == v:
                r += 1
                continue
            pc = <double>row[v]
            if pc > 0.0:
                running += pc
                last_positive = v
                if running > threshold:
                    chosen = v
                    break
        if chosen < 0:
            chosen = last_positive       # threshold beyond the rounded running sum
        if chosen < 0:                   # only rounding left mass outside the rejected tokens
            best = -1.0
            for v in range(vocab):
                if <double>row[v] > best:
                    best = <double>row[v]
                    chosen = v
        acc[a - 1] = chosen
        return a


def verify_sample(tokens, parents_local, target_probs, uniforms):
    """Lossless sampling verification of a deterministic top-k tree (SpecInfer / EAGLE rule).

    At the current node (starting at the root) with target distribution p = the node's row
    (normalized by its float64 sum, taken in four interleaved lanes), the residual r starts as p; its children are tried in local
    order: child c is accepted with probability r(c) (one uniform each); on rejection r(c) is set
    to 0 and r renormalized. An accepted child becomes the current node (restart with its own
    row). If every child is rejected (or there is none), the bonus token is drawn from r by
    inverse CDF over token ids with the next uniform, and the walk stops. The committed tokens
    are then distributed exactly as sampling the target token by token.

    Args:
        tokens: int64[n] node tokens; tokens[1:] must lie in [0, V).
        parents_local: int32[n], topological, parents_local[0] == -1.
        target_probs: float32 or float64 [n, V], C-contiguous: the target's next-token
            distribution after each node (temperature applied, normalized). Never modified.
        uniforms: float64[>= n + 1] in [0, 1), consumed in order (at most n are used).

    Returns:
        path: int32[a], local indices from the root (path[0] == 0).
        accepted_tokens: int64[a], tokens[path[1:]] followed by the bonus token.
    """
    tok_arr = _as_1d(tokens, _DT_I64, "verify_sample: tokens")
    par_arr = _as_1d(parents_local, _DT_I32, "verify_sample: parents_local")
    u_arr = _as_1d(uniforms, _DT_F64, "verify_sample: uniforms")
    probs = _as_real_2d(target_probs, "verify_sample: target_probs")
    cdef Py_ssize_t n = par_arr.shape[0]
    if tok_arr.shape[0] != n or probs.shape[0] != n:
        raise ValueError(f"verify_sample: need tokens [n], parents_local [n], target_probs "
                         f"[n, V]; got {tok_arr.shape}, {par_arr.shape}, {probs.shape}")
    if u_arr.shape[0] < n + 1:
        raise ValueError(f"verify_sample: need >= n + 1 = {n + 1} uniforms, got "
                         f"{u_arr.shape[0]}")
    cdef const int32_t* parents = _i32_ptr(par_arr) if n else NULL
    _check_parents(parents, n, "verify_sample")
    cdef Py_ssize_t vocab = probs.shape[1]
    cdef const int64_t* tok = _i64_ptr(tok_arr)
    cdef Py_ssize_t j
    for j in range(1, n):
        if tok[j] < 0 or tok[j] >= vocab:
            raise ValueError(f"verify_sample: tokens[{j}] = {tok[j]} outside the vocabulary "
                             f"[0, {vocab})")
    path_buf = np.empty(n, _DT_I32)
    acc_buf = np.empty(n, _DT_I64)
    cdef const double* u_ptr = _f64_ptr(u_arr)
    cdef int32_t* path_ptr = _i32_ptr(path_buf)
    cdef int64_t* acc_ptr = _i64_ptr(acc_buf)
    cdef int64_t* rejected_ptr = <int64_t*>malloc(n * sizeof(int64_t))
    if rejected_ptr == NULL:
        raise MemoryError()
    cdef const float* probs32
    cdef const double* probs64
    cdef Py_ssize_t a
    if probs.dtype is _DT_F32:
        probs32 = <const float*>_data(probs)
        with nogil:
            a = _sample_walk(probs32, vocab, tok, parents, n, u_ptr, path_ptr, acc_ptr,
                             rejected_ptr)
    else:
        probs64 = <const double*>_data(probs)
        with nogil:
            a = _sample_walk(probs64, vocab, tok, parents, n, u_ptr, path_ptr, acc_ptr,
                             rejected_ptr)
    free(rejected_ptr)
    if a < 0:
        raise ValueError(f"verify_sample: target_probs row {-a - 1} has no positive mass")
    return path_buf[:a], acc_buf[:a]
