/* comm_shm_window.h — the layout of a shared window (ac/comm_shm.h), shared by the file that maps
 * it (comm_shm_window.c) and the collective that reduces through it (comm_shm.c). Internal. */
#ifndef AC_COMM_SHM_WINDOW_H
#define AC_COMM_SHM_WINDOW_H

#include <stddef.h>

#include "ac/comm_shm.h"

struct ac_shm_window {
  unsigned char *map; /* the whole segment: a header page, then one region per rank */
  size_t map_bytes;
  size_t region_bytes; /* each region's size (a multiple of 4096) */
  size_t usable_bytes; /* what the caller asked for */
  int nranks, rank;
  unsigned serial; /* the group's window counter at creation: the same window on every rank */
};

/* Rank q's region. */
static inline unsigned char *ac_shm_window_region(const ac_shm_window_t *w, int q) {
  return w->map + 4096 + (size_t)q * w->region_bytes;
}

/* What comm_shm.c lends the window code: the next window's segment name (the group's name, "-w"
 * and a counter; every rank counts its windows alike) and the group's timeout; and the segment
 * opener ac_shm_create uses (rank 0 creates and reserves `total` bytes, the others wait for it). */
void ac_shm_next_window_name(ac_shm_t *c, char *name, size_t cap, int *timeout_ms, unsigned *serial);
ac_result_t ac_shm_open_segment(const char *name, int rank, size_t total, double deadline, int *fd);
double ac_shm_now_s(void);

#endif /* AC_COMM_SHM_WINDOW_H */
