/*
 * cupti_trace.c - a CUPTI injection library that writes the start and end
 * of every kernel a CUDA process runs (graph replays included) to a CSV
 * file: the timeline of a decoded token as the GPU ran it, where Nsight
 * Compute times each kernel on its own and Nsight Systems is not at hand.
 *
 * Build (against the CUPTI of the machine that runs it):
 *     cc -O2 -shared -fPIC -o cupti_trace.so scripts/cupti_trace.c -I$CUPTI/include -L$CUPTI/lib -lcupti
 * Use:
 *     CUDA_INJECTION64_PATH=$PWD/cupti_trace.so DS4_TRACE_OUT=trace.csv build/cuda/ds4server bench ...
 * The CUDA driver loads the library at initialisation and calls
 * InitializeInjection. Kernels are recorded as CONCURRENT_KERNEL activities
 * (no serialisation); at exit the records are flushed and written, one
 * line per kernel: start_ns,end_ns,graph_id,graph_node_id,stream,
 * grid_x,grid_y,grid_z,block_x,registers,dynamic_smem,name (mangled).
 * scripts/timeline.py reads the file. KREC names the kernel record struct
 * of the CUPTI version built against (CUpti_ActivityKernel13 by default).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cupti_activity.h>

#ifndef KREC
#define KREC CUpti_ActivityKernel13
#endif

#define TRACE_BUF (8u << 20)

static FILE *g_out;
static uint64_t g_kernels, g_dropped;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, TRACE_BUF);
    *size = *buffer ? TRACE_BUF : 0;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *rec = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
        const KREC *k = (const KREC *)rec;
        g_kernels++;
        if (g_out)
            fprintf(g_out, "%llu,%llu,%u,%llu,%u,%d,%d,%d,%d,%u,%d,%s\n", (unsigned long long)k->start,
                    (unsigned long long)k->end, (unsigned)k->graphId, (unsigned long long)k->graphNodeId,
                    (unsigned)k->streamId, k->gridX, k->gridY, k->gridZ, k->blockX, (unsigned)k->registersPerThread,
                    k->dynamicSharedMemory, k->name ? k->name : "?");
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS) g_dropped += dropped;
    free(buffer);
}

static void trace_finish(void) {
    cuptiActivityFlushAll(1);
    if (g_out) fclose(g_out);
    g_out = NULL;
    fprintf(stderr, "cupti_trace: %llu kernels recorded, %llu records dropped\n", (unsigned long long)g_kernels,
            (unsigned long long)g_dropped);
}

int InitializeInjection(void) {
    const char *path = getenv("DS4_TRACE_OUT");
    g_out = fopen(path && *path ? path : "trace.csv", "w");
    if (!g_out) {
        fprintf(stderr, "cupti_trace: cannot open %s\n", path && *path ? path : "trace.csv");
        return 0;
    }
    fprintf(g_out, "start_ns,end_ns,graph_id,graph_node_id,stream,grid_x,grid_y,grid_z,block_x,registers,"
                   "dynamic_smem,name\n");
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "cupti_trace: CUPTI refused the kernel activity\n");
        fclose(g_out);
        g_out = NULL;
        return 0;
    }
    atexit(trace_finish);
    return 1;
}
