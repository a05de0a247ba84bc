# swiftspec-mpi: rank placement over the nodes of a job, and what srun's failures mean.
# Sourced by jobs/generate.sbatch and jobs/generate-gpu.sbatch (not run on its own).
#
# The engine fixes the rank order: world ranks [0, V) are the verify group (target model, rank 0
# its leader, which streams the text and writes the HDF5 file), ranks [V, N) the draft group.
# On one node nothing is placed (Slurm's default block layout). On several nodes a hostfile names
# the node of every rank, in rank order, and srun takes it with --distribution=arbitrary (Slurm
# reads the file from SLURM_HOSTFILE):
#   async:    the draft ranks go to the DRAFT_NODES (default: the allocation's last node), the
#             verify ranks to the other nodes (all of them when DRAFT_NODES is every node);
#   sync, ar: every rank over every node.
# Inside each set, ranks fill the nodes in order, as evenly as they divide (2 verify ranks on 2
# nodes: one each; 6 on 2: three each), so a group spans the nodes it was given and no more.

# place_ranks MODE NTASKS DRAFT_RANKS DRAFT_NODES HOSTFILE
#   -> PLACE_ARGS (srun options, empty on one node) and PLACEMENT ("rank 0 (verify) node1, ...");
#      exits 2 with one line when the placement cannot be honoured.
place_ranks() {
    local mode=$1 ntasks=$2 draft=$3 draft_spec=$4 hostfile=$5
    PLACE_ARGS=()
    PLACEMENT=""
    local -a nodes draft_nodes verify_nodes hosts
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    (( ${#nodes[@]} > 1 )) || return 0
    if [[ $mode != async ]]; then
        draft=0
        verify_nodes=("${nodes[@]}")
    else
        if [[ -n $draft_spec ]]; then
            mapfile -t draft_nodes < <(scontrol show hostnames "$draft_spec")
        else
            draft_nodes=("${nodes[-1]}")
        fi
        local d n found
        for d in "${draft_nodes[@]}"; do
            found=0
            for n in "${nodes[@]}"; do [[ $n == "$d" ]] && found=1; done
            (( found )) || place_die "DRAFT_NODES names $d, which is not in this job's nodes ($SLURM_JOB_NODELIST)"
        done
        for n in "${nodes[@]}"; do
            found=0
            for d in "${draft_nodes[@]}"; do [[ $n == "$d" ]] && found=1; done
            (( found )) || verify_nodes+=("$n")
        done
        (( ${#verify_nodes[@]} )) || verify_nodes=("${nodes[@]}")
    fi
    local verify=$(( ntasks - draft ))
    spread verify_nodes "$verify" hosts
    (( draft > 0 )) && spread draft_nodes "$draft" hosts
    check_room hosts nodes
    printf '%s\n' "${hosts[@]}" > "$hostfile"
    export SLURM_HOSTFILE=$hostfile
    PLACE_ARGS=(--distribution=arbitrary)
    local r role
    for r in "${!hosts[@]}"; do
        role=verify; (( r >= verify )) && role=draft
        PLACEMENT+="${PLACEMENT:+, }rank $r ($role) ${hosts[$r]}"
    done
}

# spread NODES_ARRAY COUNT OUT_ARRAY: append COUNT hosts to OUT, the nodes filled in order, evenly
spread() {
    local -n from=$1 out=$3
    local count=$2 m=${#from[@]} i k share
    for (( i = 0; i < m; i++ )); do
        share=$(( count / m + (i < count % m ? 1 : 0) ))
        for (( k = 0; k < share; k++ )); do out+=("${from[$i]}"); done
    done
}

# check_room HOSTS_ARRAY NODES_ARRAY: every node has the CPUs its ranks need in this allocation
check_room() {
    local -n want=$1 all=$2
    local -a alloc=() parts=()
    local part cpus times k
    IFS=, read -r -a parts <<< "${SLURM_JOB_CPUS_PER_NODE:-}"
    for part in "${parts[@]}"; do            # "4(x2),1" -> 4 4 1
        cpus=${part%%(*}; times=1
        [[ $part == *"(x"* ]] && { times=${part#*(x}; times=${times%)}; }
        for (( k = 0; k < times; k++ )); do alloc+=("$cpus"); done
    done
    local per_task=${SLURM_CPUS_PER_TASK:-1} i n count h
    for (( i = 0; i < ${#all[@]}; i++ )); do
        n=${all[$i]}
        count=0
        for h in "${want[@]}"; do [[ $h == "$n" ]] && count=$(( count + 1 )); done
        if [[ -n ${alloc[$i]:-} ]] && (( count * per_task > alloc[i] )); then
            place_die "the placement puts $count ranks x $per_task cores on $n, but this job has ${alloc[$i]} cores there; sbatch --ntasks-per-node=$count (or --exclusive)"
        fi
    done
}

place_die() { echo "${PLACE_SCRIPT:-placement}: error: $*" >&2; exit 2; }

# report_srun_failure ERRLOG VERIFY_RANKS: one line saying which rank on which node was lost,
# from srun's own messages (a rank killed by a signal, a node whose ranks could not start).
# Silent when the engine itself ended the job (it printed its own one-line error).
report_srun_failure() {
    local errlog=$1 verify=$2 line node task what role
    grep -q 'swiftspec run: error' "$errlog" && return 0     # the engine named the failure itself
    line=$(grep -m1 -E '^srun: error: Task launch for .* failed on node ' "$errlog" || true)
    if [[ -n $line ]]; then
        node=$(sed -E 's/.* failed on node ([^:]+):.*/\1/' <<< "$line")
        echo "${PLACE_SCRIPT:-srun}: error: the ranks could not start on $node (${line#srun: error: }); see \`scontrol show node $node\`" >&2
        return
    fi
    line=$(grep -m1 -E '^srun: error: [^:]+: tasks? [0-9,-]+: (Killed|Terminated|Segmentation fault|Aborted|Bus error|Hangup|Interrupt)' "$errlog" || true)
    if [[ -n $line ]]; then
        node=$(sed -E 's/^srun: error: ([^:]+): .*/\1/' <<< "$line")
        task=$(sed -E 's/^srun: error: [^:]+: tasks? ([0-9]+).*/\1/' <<< "$line")
        what=${line##*: }
        role=verify; (( task >= verify )) && role=draft
        echo "${PLACE_SCRIPT:-srun}: error: rank $task ($role) on $node was lost ($what); srun ended the other ranks" >&2
        return
    fi
    line=$(grep -m1 -E '^srun: error: (Unable to create step|.*[Nn]ode.*(down|not responding|fail))' "$errlog" || true)
    [[ -n $line ]] && echo "${PLACE_SCRIPT:-srun}: error: ${line#srun: error: }" >&2
    return 0
}
